"""onnx-mlir defect: TopK along any axis but the last does not compile.

    python tests/repros/onnx_mlir_topk_inner_axis.py [out.onnx]

builds ONE TopK (x [2, 3, 4], K 2, axis 1), writes it, and compiles it with ``onnx-mlir --EmitLib -O3``
through bridge.compile: "failed to legalize operation 'onnx.TopK'" (for largest 0 and 1, sorted 0 and
1). The same TopK along axis -1 compiles and matches onnxruntime; onnx-mlir's op table lists TopK as
supported with only a static-K limitation.

The op-database row TopK-smallest_axis1 (axis 1) hits it. Not yet avoided: the form that compiles is
TopK along the last axis between two Transposes (``Transpose(perm moving axis last) -> TopK(axis=-1) ->
Transpose back`` for values and indices).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if not __package__:  # run as a script: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repros import print_compile  # noqa: E402


def build(axis: int = 1) -> onnx.ModelProto:
    """``values, indices = TopK(x, 2, axis)`` of x [2, 3, 4]."""
    node = helper.make_node("TopK", ["x", "k"], ["values", "indices"], name="topk", axis=axis)
    shape = [2, 3, 4]
    shape[axis] = 2
    graph = helper.make_graph([node], "topk_inner_axis", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, shape),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, shape)],
                              [numpy_helper.from_array(np.array([2], np.int64), "k")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for axis in (1, -1):
        print_compile(f"TopK axis {axis}", build(axis), backend="onnx-mlir")
