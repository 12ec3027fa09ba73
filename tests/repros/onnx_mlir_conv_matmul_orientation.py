"""onnx-mlir limits on a CNN's training step: its im2col MatMul is slower with few rows, and slower than onnxruntime's Conv.

    python tests/repros/onnx_mlir_conv_matmul_orientation.py [out_folder]

builds one-op graphs at the shapes of small_cnn's second Conv (benchmarks/models.py: batch 16, 16 -> 32
channels, 3x3 at 16x16) and of resnet18's layer1 and layer3 Convs (batch 8, 3x64x64 input: 64 channels at
16x16, 256 at 4x4), compiles each with ``onnx-mlir --EmitLib -O3 --mcpu=native`` (as benchmarks/run.py does)
and times it against onnxruntime at one thread (``onnx_mlir_slow_ops.compare``: CPU time, the least of
``REPEATS`` calls, malloc keeping freed memory as bridge's session has it). For each Conv:

- ``[Cout, K] @ [K, N*H*W]``: the forward im2col product as the ``onnx-mlir`` target emits it
  (``dense_conv_as_matmul``: weight rows, patch columns);
- ``[N*H*W, K] @ [K, Cout]``: the same product transposed (the same multiply-adds and sums);
- ``Conv``: the Conv itself in onnxruntime, what onnxruntime's step runs (im2col inside MLAS).

onnx-mlir's tiled MatMul runs the few-rows orientation at several times onnxruntime's time, the many-rows
one closer to it; neither reaches onnxruntime's Conv, which needs no im2col copies in the graph (the
Slices and Concats that build the columns cost onnx-mlir a further third of small_cnn's step).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CONVS = {  # name -> (batch, input channels, input side, output channels) of a 3x3 Conv, pads 1, stride 1
    "small_cnn conv 2": (16, 16, 16, 32),
    "resnet18 layer1": (8, 64, 16, 64),
    "resnet18 layer3": (8, 256, 4, 256),
}
FLAGS = ("--mcpu=native",)


def cases(batch: int, in_channels: int, side: int, out_channels: int) -> dict[str, tuple]:
    """The two orientations of the Conv's im2col product (``onnx_mlir_slow_ops.build``'s arguments)."""
    inner, columns = in_channels * 9, batch * side * side
    return {"[Cout, K] @ [K, N*H*W]": ("MatMul", {}, [[out_channels, inner], [inner, columns]], [out_channels, columns]),
            "[N*H*W, K] @ [K, Cout]": ("MatMul", {}, [[columns, inner], [inner, out_channels]], [columns, out_channels])}


def onnxruntime_conv_ms(batch: int, in_channels: int, side: int, out_channels: int) -> float:
    """onnxruntime's time of the Conv itself at one thread (ms)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from repros.onnx_mlir_slow_ops import fastest_ms

    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, in_channels, side, side]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [out_channels, in_channels, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal([batch, in_channels, side, side]).astype(np.float32),
            "w": rng.standard_normal([out_channels, in_channels, 3, 3]).astype(np.float32)}
    return fastest_ms(lambda: session.run(None, feed))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repros.* when run as a script
    from bridge.training.runtime_onnx_mlir import keep_freed_memory
    from repros.onnx_mlir_slow_ops import build, compare

    keep_freed_memory()  # as bridge's onnx-mlir session runs
    keep = sys.argv[1] if len(sys.argv) > 1 else None
    for conv, shape in CONVS.items():
        batch, in_channels, side, out_channels = shape
        print(f"{conv} ({batch}x{in_channels}x{side}x{side} -> {out_channels} channels): "
              f"onnxruntime's Conv {onnxruntime_conv_ms(*shape):.3f} ms")
        for name, (op, attributes, shapes, output) in cases(*shape).items():
            with tempfile.TemporaryDirectory() as scratch:
                folder = tempfile.mkdtemp(dir=keep) if keep else scratch
                mlir_ms, ort_ms, error = compare(build(op, attributes, shapes, output), folder, FLAGS)
            print(f"  {name}: onnx-mlir {mlir_ms:.3f} ms, onnxruntime {ort_ms:.3f} ms ({mlir_ms / ort_ms:.1f}x), "
                  f"outputs differ by {error:.1e} of their scale")
