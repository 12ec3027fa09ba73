"""IREE 3.13 defect: a strided Conv whose output is 1 wide along an axis while its padded input
is longer than the window reads fails to compile.

    python tests/repros/iree_conv_unread_pad.py [out.onnx]

builds ONE Conv (x [1, 1, 2, 2], W [1, 1, 3, 3], stride 2, pads 1: output [1, 1, 1, 1]; the
window reads 3 of the 4 padded elements per axis), writes it, and compiles it with IREE
(``iree-compile --iree-input-type=onnx``, llvm-cpu) through bridge.compile:

    error: 'linalg.generic' op inferred input/output operand #1 has shape's dimension #0 to be 4, but found 3

onnxruntime runs it. The same Conv with pads [1, 1, 0, 0] (begin 1, end 0: exactly the read
extent) compiles and gives the same result; that is the form bridge emits
(``bridge/pipeline/export/ops/nn.py`` ``_fit_to_read_extent``). So does an explicit Pad [1, 0] + valid
Conv; an explicit Pad [1, 1] + valid Conv fails the same way.
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(end_pad: int = 1) -> onnx.ModelProto:
    """The one-Conv model; ``end_pad=0`` is the form that compiles."""
    weight = numpy_helper.from_array(np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3), "W")
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="strided_conv", kernel_shape=[3, 3], strides=[2, 2],
                            pads=[1, 1, end_pad, end_pad])
    graph = helper.make_graph([node], "conv_unread_pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 1])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    import bridge

    model = build()
    if len(sys.argv) > 1:
        onnx.save(model, sys.argv[1])
    for end_pad in (1, 0):
        try:
            bridge.compile(build(end_pad))
            print(f"pads [1, 1, {end_pad}, {end_pad}]: compiles")
        except bridge.CompileError as exc:
            print(f"pads [1, 1, {end_pad}, {end_pad}]: {exc}")
