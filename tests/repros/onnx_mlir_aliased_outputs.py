"""onnx-mlir defect: two graph outputs that are one tensor (``b = Identity(a)``, both outputs) are
returned as two OMTensors owning the same buffer, and releasing them aborts the process.

    python tests/repros/onnx_mlir_aliased_outputs.py [out.onnx]

builds ``a = Relu(x)`` and ``b``, a view of ``a``, with outputs ``a`` and ``b``, writes the first, compiles each
with ``onnx-mlir --EmitLib -O3`` as it is and through ``bridge.compile``, and runs it through onnx-mlir's
Python runtime in a child process. As it is, the values are right, then the child dies with ``free(): double
free detected in tcache 2`` (SIGABRT) as the outputs are released, for ``b`` any of ``Identity(a)``,
``Reshape(a, ...)``, ``Unsqueeze(a, ...)``, ``Cast(a)`` to its own type, ``Mul(a, 1)``, ``Add(a, 0)`` (and chains
of them; two Reshapes of one hidden value too). ``Flatten(a)``, ``b = Identity(x)`` of a graph input and
``b = Expand(a, shape of a)`` get their own buffer and run. onnxruntime runs all of them. ``bridge.compile``
gives each such later output a copy, ``Expand(b, Shape(b))``, and every form runs.

bridge's training graphs hit it wherever two trained tensors get one gradient value: the biases of the
two branches of a residual Add (a resnet block's bn2 and downsample BatchNorm: the zoo's resnet18 at a
static batch aborts so) give ``grad_b2 = Identity(grad_b1)``, and the two weights here too. ``training``
builds that graph with bridge (``python ... training``).
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

if not __package__:  # run as a script: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ALIASES = {  # form -> the node making b from a
    "identity": helper.make_node("Identity", ["a"], ["b"], name="alias"),
    "reshape": helper.make_node("Reshape", ["a", "flat"], ["b"], name="alias"),
    "unsqueeze": helper.make_node("Unsqueeze", ["a", "axis"], ["b"], name="alias"),
    "cast": helper.make_node("Cast", ["a"], ["b"], to=TensorProto.FLOAT, name="alias"),
    "mul_one": helper.make_node("Mul", ["a", "one"], ["b"], name="alias"),
    "add_zero": helper.make_node("Add", ["a", "zero"], ["b"], name="alias"),
    "expand": helper.make_node("Expand", ["a", "shape"], ["b"], name="alias"),
}
FORMS = tuple(ALIASES)


def build(*forms: str) -> onnx.ModelProto:
    """``a = Relu(x)`` and, per form, a view of ``a`` (``b``, or ``b_<form>`` for several); all are outputs."""
    forms = forms or ("identity",)
    constants = [numpy_helper.from_array(np.array(v, dtype), n) for n, v, dtype in
                 (("shape", [2, 3], np.int64), ("flat", [6], np.int64), ("axis", [0], np.int64),
                  ("one", 1.0, np.float32), ("zero", 0.0, np.float32))]
    nodes, outputs = [helper.make_node("Relu", ["x"], ["a"], name="relu")], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])]
    for form in forms:
        view = onnx.NodeProto()
        view.CopyFrom(ALIASES[form])
        view.output[0] = view.name = "b" if len(forms) == 1 else f"b_{form}"
        nodes.append(view)
        shape = {"reshape": [6], "unsqueeze": [1, 2, 3]}.get(form, [2, 3])
        outputs.append(helper.make_tensor_value_info(view.output[0], TensorProto.FLOAT, shape))
    graph = helper.make_graph(nodes, f"aliased_outputs_{'_'.join(forms)}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              outputs, constants)
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
    would take this one down): its return code, stdout (the outputs' count and, element by element, the
    largest difference of each output from the first) and stderr."""
    inputs = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    dtypes = [onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name for i in model.graph.input]
    code = ("import sys, numpy as np; sys.path.append(sys.argv[1]); from PyRuntime import OMExecutionSession\n"
            f"s = OMExecutionSession(sys.argv[2], tag='NONE'); rng = np.random.default_rng(0)\n"
            f"outs = s.run([rng.standard_normal(sh).astype(dt).reshape(sh) for sh, dt in zip({inputs}, {dtypes})])\n"
            "print('outputs', len(outs), 'differ', [float(np.max(np.abs(o.ravel() - outs[0].ravel()))) "
            "if o.size == outs[0].size else None for o in outs[1:]], flush=True)\n"
            "del outs; print('released', flush=True)")
    lib = str(Path(os.environ.get("ONNX_MLIR_HOME", "/work/shared/onnx-mlir/install")) / "lib")
    return subprocess.run([sys.executable, "-c", code, lib, library], capture_output=True, text=True)


def compile_and_run(model: onnx.ModelProto, through_bridge: bool = True) -> subprocess.CompletedProcess:
    """``model`` compiled through ``bridge.compile`` (or as it is) and run once in a child process."""
    import bridge
    from repros.onnx_mlir_defects import compile_as_is

    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder) / "bridge.so"
        if through_bridge:
            bridge.compile(model, backend="onnx-mlir", output=library)
        return run_child(str(library) if through_bridge else compile_as_is(model, folder), model)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "training":
        onnx.save(build(), sys.argv[1])
    cases = {"training": training().model} if "training" in sys.argv[1:] else {form: build(form) for form in FORMS}
    for name, model in cases.items():
        for through_bridge in (False, True):
            result = compile_and_run(model, through_bridge)
            print(f"{name}, {'bridge.compile' if through_bridge else 'as it is'}: return code {result.returncode}, "
                  f"{result.stdout.split()[-1:]} {result.stderr.strip()[-60:]}")
