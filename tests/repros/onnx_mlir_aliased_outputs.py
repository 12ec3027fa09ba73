"""onnx-mlir defect: two graph outputs that are one tensor (``b = Identity(a)``, both outputs) are
returned as two OMTensors owning the same buffer, and releasing them aborts the process.

    python tests/repros/onnx_mlir_aliased_outputs.py [out.onnx]

builds ``a = Relu(x); b = Identity(a)`` with outputs ``a`` and ``b``, writes it, compiles it with
``onnx-mlir --EmitLib -O3`` and runs it through onnx-mlir's Python runtime in a child process: the
values are right, then the child dies with ``free(): double free detected in tcache 2`` (SIGABRT) as
the outputs are released. The same happens for ``b = Reshape(a, shape of a)`` and ``b = Mul(a, 1)``
(folded to ``a``); ``b = Identity(x)`` of a graph input is copied and runs. onnxruntime runs all of them.

bridge's training graphs hit it wherever two trained tensors get one gradient value: the biases of the
two branches of a residual Add (a resnet block's bn2 and downsample BatchNorm: the zoo's resnet18 at a
static batch aborts so; timm resnet10t's abort is likely the same) give ``grad_b2 = Identity(grad_b1)``,
and the two weights here too. ``training`` builds
that graph with bridge (``python ... training``). ``b = Expand(a, shape of a)`` is not folded: the
second output gets its own buffer and the library runs (``--form expand``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FORMS = ("identity", "reshape", "expand")


def build(form: str = "identity") -> onnx.ModelProto:
    """``a = Relu(x)`` and ``b``, ``a`` in ``form``; both are graph outputs."""
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu")]
    if form == "identity":
        nodes.append(helper.make_node("Identity", ["a"], ["b"], name="alias"))
    else:
        nodes.append(helper.make_node(form.capitalize(), ["a", "shape"], ["b"], name="alias"))
    graph = helper.make_graph(nodes, f"aliased_outputs_{form}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("a", "b")],
                              [] if form == "identity" else [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def training():
    """bridge's TrainingModel of ``y = (x W1 + b1) + (x W2 + b2)`` (mse, SGD): ``grad_W2`` and ``grad_b2``
    are Identities of ``grad_W1`` and ``grad_b1``."""
    import bridge

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
               for n, s in (("W1", (3, 4)), ("b1", (4,)), ("W2", (3, 4)), ("b2", (4,)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("MatMul", ["x", "W2"], ["m2"]), helper.make_node("Add", ["m2", "b2"], ["a2"]),
             helper.make_node("Add", ["a1", "a2"], ["y"])]
    graph = helper.make_graph(nodes, "residual_biases", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.1})


def run_child(library: str, model: onnx.ModelProto) -> subprocess.CompletedProcess:
    """Run ``library`` once on random inputs of ``model``'s input shapes in a child process (the abort
    would take this one down): its return code, stdout and stderr."""
    inputs = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    dtypes = [onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name for i in model.graph.input]
    code = ("import sys, numpy as np; sys.path.append(sys.argv[1]); from PyRuntime import OMExecutionSession\n"
            f"s = OMExecutionSession(sys.argv[2], tag='NONE'); rng = np.random.default_rng(0)\n"
            f"outs = s.run([rng.standard_normal(sh).astype(dt).reshape(sh) for sh, dt in zip({inputs}, {dtypes})])\n"
            "print('outputs', len(outs), flush=True); del outs; print('released', flush=True)")
    lib = str(Path(os.environ.get("ONNX_MLIR_HOME", "/work/shared/onnx-mlir/install")) / "lib")
    return subprocess.run([sys.executable, "-c", code, lib, library], capture_output=True, text=True)


def compile_and_run(model: onnx.ModelProto) -> subprocess.CompletedProcess:
    import bridge

    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder) / "model.so"
        bridge.compile(model, backend="onnx-mlir", output=library)
        return run_child(str(library), model)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "training":
        onnx.save(build(), sys.argv[1])
    cases = {"training": training().model} if "training" in sys.argv[1:] else {form: build(form) for form in FORMS}
    for name, model in cases.items():
        result = compile_and_run(model)
        print(f"{name}: return code {result.returncode}, {result.stdout.split()[-1:]} {result.stderr.strip()[-60:]}")
