"""onnx-mlir defect: a MatMul reading ``Reshape(Transpose(Reshape(x)))`` that moves a symbolic batch dim
computes wrong rows once the batch is above 1.

    python tests/repros/onnx_mlir_transpose_reshape_matmul.py [out.onnx]

builds two such graphs (the shapes computed from ``Shape(x)``), writes the first, compiles each with
``onnx-mlir --EmitLib -O3`` as it is and through ``bridge.compile``, and runs each library at batch 1, 2
and 3 against onnxruntime (one thread):

- ``convtranspose``, x [batch, 3, 5], B [5 * batch, 6]: ``r = Reshape(x, [batch, 1, 3, 5])``,
  ``t = Transpose(r, [1, 2, 0, 3])``, ``y = MatMul(Reshape(t, [3, 5 * batch]), B)``: bridge's ConvTranspose
  weight gradient (onnxruntime target) with a symbolic batch;
- ``pooled``, g [batch, 4], p [batch, 2]: ``r = Reshape(g, [batch, 4, 1, 1])``, ``t = Transpose(r, [1, 0, 2, 3])``,
  ``y = MatMul(Reshape(t, [4, batch]), p)``: the weight gradient of a 1x1 Conv after a global pool, the
  gradient coming through a Flatten (timm lcnet_050's ``conv_head`` and squeeze-excitation ``conv_reduce``,
  onnxruntime target, symbolic batch: gradients off by 170-550% of their scale).

As it is: equal at batch 1, the first row of y right and the others off by O(1) at 2 and 3. The reshaped
operand alone (as an output) is right, and so is the graph with a static batch, with the operand a graph
input, or with a Gemm in place of the MatMul. ``bridge.compile`` copies such an operand first,
``Expand(a, Shape(a))``, and then every batch matches.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if not __package__:  # run as a script: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMS = ("convtranspose", "pooled")


def build(form: str = "convtranspose") -> onnx.ModelProto:
    """The graph of ``form`` above, ``y`` its output."""
    def const(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)

    x, rows, unit_shape, perm, per_sample, other = {
        "convtranspose": ("x", 3, [1, 3, 5], [1, 2, 0, 3], 5, "B"),
        "pooled": ("g", 4, [4, 1, 1], [1, 0, 2, 3], 1, "p"),
    }[form]
    constants = [const("zero", [0]), const("one", [1]), const("rows", [rows]), const("per_sample", [per_sample]),
                 const("tail", unit_shape)]
    nodes = [helper.make_node("Shape", [x], ["shape"]), helper.make_node("Slice", ["shape", "zero", "one", "zero"], ["batch"]),
             helper.make_node("Concat", ["batch", "tail"], ["unit_shape"], axis=0),
             helper.make_node("Reshape", [x, "unit_shape"], ["r"], name="unit_dims"),
             helper.make_node("Transpose", ["r"], ["t"], perm=perm, name="move_batch"),
             helper.make_node("Mul", ["per_sample", "batch"], ["k"]), helper.make_node("Concat", ["rows", "k"], ["flat"], axis=0),
             helper.make_node("Reshape", ["t", "flat"], ["a"], name="flatten"),
             helper.make_node("MatMul", ["a", other], ["y"], name="matmul")]
    inputs = {"convtranspose": [("x", ["batch", 3, 5]), ("B", ["k", 6])], "pooled": [("g", ["batch", 4]), ("p", ["batch", 2])]}[form]
    graph = helper.make_graph(nodes, f"transpose_reshape_matmul_{form}",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, None])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def feed(form: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"convtranspose": {"x": (batch, 3, 5), "B": (5 * batch, 6)}, "pooled": {"g": (batch, 4), "p": (batch, 2)}}[form]
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def errors(form: str = "convtranspose", through_bridge: bool = False, batches=(1, 2, 3)) -> dict[int, float]:
    """Per batch size, onnx-mlir's largest error against onnxruntime on random inputs: the graph compiled
    as it is, or through ``bridge.compile`` (its avoided form)."""
    import onnxruntime

    import bridge
    from bridge.training.runtime_onnx_mlir import OnnxMlirGraph
    from repros.onnx_mlir_defects import compile_as_is

    model = build(form)
    with tempfile.TemporaryDirectory() as folder:
        library = bridge.compile(model, backend="onnx-mlir").module if through_bridge else \
            open(compile_as_is(model, folder), "rb").read()
    compiled = OnnxMlirGraph(library, model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    ort = onnxruntime.InferenceSession(model.SerializeToString(), options)
    rng = np.random.default_rng(0)
    found = {}
    for batch in batches:
        values = feed(form, batch, rng)
        found[batch] = float(np.max(np.abs(compiled(values)["y"] - ort.run(None, values)[0])))
    return found


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for form in FORMS:
        for through_bridge in (False, True):
            found = ", ".join(f"batch {b}: {e:.3g}" for b, e in errors(form, through_bridge).items())
            print(f"{form}, {'bridge.compile' if through_bridge else 'as it is'}: largest error vs onnxruntime {found}")
