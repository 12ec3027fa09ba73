"""onnx-mlir defect: a MatMul reading a Reshape of a Transpose that moves a symbolic batch dim computes
wrong rows once the batch is above 1.

    python tests/repros/onnx_mlir_transpose_reshape_matmul.py [out.onnx]

builds, with x [batch, 3, 5] and B [k, 6] (k = 5 * batch):

    r = Reshape(x, [batch, 1, 3, 5]); t = Transpose(r, perm [1, 2, 0, 3])      # [1, 3, batch, 5]
    a = Reshape(t, [3, 5 * batch]);   y = MatMul(a, B)                           # [3, 6]

(the shapes computed from Shape(x)), writes it, compiles it with ``onnx-mlir --EmitLib -O3`` and runs one
library at batch 1, 2 and 3 against onnxruntime (one thread): equal at batch 1; at 2 and 3 the first row
of y is right and the others are off by O(1). ``Transpose(x, perm [1, 0, 2])`` (no unit dim) in place of
Reshape + Transpose, and the same graph at a static batch, match.

bridge's ConvTranspose backward with a symbolic batch reads its input this way (the gradient of W is
that MatMul), so the op-database row ConvTranspose-1d_strided fails with a symbolic batch: grad_W off by
up to 4x its scale. Not yet avoided; its static conversion compiles right (the documented path).
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build() -> onnx.ModelProto:
    """The graph above, ``y`` its output."""
    def const(name, value):
        return numpy_helper.from_array(np.array(value, np.int64), name)

    constants = [const("zero", [0]), const("one", [1]), const("three", [3]), const("five", [5]), const("tail", [1, 3, 5])]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Slice", ["shape", "zero", "one", "zero"], ["batch"]),
             helper.make_node("Concat", ["batch", "tail"], ["shape4"], axis=0),
             helper.make_node("Reshape", ["x", "shape4"], ["r"], name="unit_dim"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[1, 2, 0, 3], name="move_batch"),
             helper.make_node("Mul", ["five", "batch"], ["k"]), helper.make_node("Concat", ["three", "k"], ["shape2"], axis=0),
             helper.make_node("Reshape", ["t", "shape2"], ["a"], name="flatten"),
             helper.make_node("MatMul", ["a", "B"], ["y"], name="matmul")]
    graph = helper.make_graph(nodes, "transpose_reshape_matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 5]),
                               helper.make_tensor_value_info("B", TensorProto.FLOAT, ["k", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def errors(batches=(1, 2, 3)) -> dict[int, float]:
    """Per batch size, onnx-mlir's largest error against onnxruntime on random x and B."""
    import onnxruntime

    import bridge
    from bridge.training.runtime_onnx_mlir import OnnxMlirGraph

    model = build()
    compiled = OnnxMlirGraph(bridge.compile(model, backend="onnx-mlir").module, model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    ort = onnxruntime.InferenceSession(model.SerializeToString(), options)
    rng = np.random.default_rng(0)
    found = {}
    for batch in batches:
        feed = {"x": rng.standard_normal((batch, 3, 5)).astype(np.float32), "B": rng.standard_normal((5 * batch, 6)).astype(np.float32)}
        found[batch] = float(np.max(np.abs(compiled(feed)["y"] - ort.run(None, feed)[0])))
    return found


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for batch, error in errors().items():
        print(f"batch {batch}: onnx-mlir vs onnxruntime, largest error {error:.3g}")
