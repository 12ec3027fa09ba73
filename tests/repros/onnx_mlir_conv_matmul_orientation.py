"""onnx-mlir limits on a CNN's training step: an im2col product with few rows is slower than the same product transposed.

    python tests/repros/onnx_mlir_conv_matmul_orientation.py [--iree] [out_folder]

builds one-op graphs at the shapes of small_cnn's second Conv (benchmarks/models.py: batch 16, 16 -> 32
channels, 3x3 at 16x16) and of resnet18's layer1, layer3 and layer4 Convs (batch 8, 3x64x64 input: 64 channels at
16x16, 256 at 4x4, 512 at 2x2), compiles each with ``onnx-mlir --EmitLib -O3 --mcpu=native`` (as benchmarks/run.py does)
and times it against onnxruntime at one thread (``onnx_mlir_slow_ops.compare``: CPU time, the least of
``REPEATS`` calls, malloc keeping freed memory as bridge's session has it). ``--iree`` times IREE instead
(bridge.compile's flags, host CPU, one worker). ``K`` is ``Cin * 9``, ``N*O`` the batch's output positions.
Each of the Conv's three products comes in the orientations bridge can emit (the same multiply-adds and sums):

- forward: ``W [Cout, K] @ cols [K, N*O]`` (few rows, many columns) against ``cols [N*O, K] @ W^T [K, Cout]``,
  the weight transposed by a Transpose or read transposed by a Gemm (``transB``);
- input gradient: ``W^T @ g [Cout, N*O]`` (a Gemm with ``transA``, or the weight transposed first) against
  ``g [N*O, Cout] @ W [Cout, K]``;
- weight gradient: ``g [Cout, N*O] @ cols [N*O, K]`` against its transposes.

In onnx-mlir a product with ``Cout`` rows and ``N*O`` columns runs at several times the time of the same
product with ``N*O`` rows, and one with a long inner dimension (``K``, or ``N*O`` in the weight gradient) runs
faster as a ``Gemm`` than as a ``MatMul``, where the result has more than a few columns: the ``onnx-mlir``
target emits the forward the many-rows way (``conv_forward_rows``) and such products as Gemms
(``long_inner_gemm``, bridge/pipeline/targets.py). At ``N*O = 32`` (resnet18's layer4, 2x2 planes) the weight
rows stay faster. The input gradient transposed (``g [N*O, Cout] @ W``) is faster at small_cnn's and layer1's
shapes, slower at layer3's; it is not emitted (its col2im would move channels-last). In IREE the many-rows
forward with the weight transposed once, and the transposed input gradient, are faster at small_cnn's and
layer1's shapes. None reaches onnxruntime's Conv (printed first), which needs no im2col copies in the graph.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CONVS = {  # name -> (batch, input channels, input side, output channels) of a 3x3 Conv, pads 1, stride 1
    "small_cnn conv 2": (16, 16, 16, 32),
    "resnet18 layer1": (8, 64, 16, 64),
    "resnet18 layer3": (8, 256, 4, 256),
    "resnet18 layer4": (8, 512, 2, 512),
}
FLAGS = ("--mcpu=native",)


def cases(batch: int, in_channels: int, side: int, out_channels: int) -> dict[str, tuple]:
    """Each orientation of the Conv's three im2col products (``onnx_mlir_slow_ops.build``'s arguments)."""
    k, n, c = in_channels * 9, batch * side * side, out_channels
    return {
        "forward W [Cout, K] @ cols [K, N*O]": ("MatMul", {}, [[c, k], [k, n]], [c, n]),
        "forward cols [N*O, K] @ W^T [K, Cout]": ("MatMul", {}, [[n, k], [k, c]], [n, c]),
        "forward cols [N*O, K] @ W [Cout, K], Gemm transB": ("Gemm", {"transB": 1}, [[n, k], [c, k]], [n, c]),
        "input grad W [Cout, K] @ g [Cout, N*O], Gemm transA": ("Gemm", {"transA": 1}, [[c, k], [c, n]], [k, n]),
        "input grad W^T [K, Cout] @ g [Cout, N*O]": ("MatMul", {}, [[k, c], [c, n]], [k, n]),
        "input grad g [N*O, Cout] @ W [Cout, K]": ("MatMul", {}, [[n, c], [c, k]], [n, k]),
        "weight grad g [Cout, N*O] @ cols [N*O, K]": ("MatMul", {}, [[c, n], [n, k]], [c, k]),
        "weight grad g [Cout, N*O] @ cols [N*O, K], Gemm": ("Gemm", {}, [[c, n], [n, k]], [c, k]),
        "weight grad g [Cout, N*O] @ cols [K, N*O], Gemm transB": ("Gemm", {"transB": 1}, [[c, n], [k, n]], [c, k]),
        "weight grad cols [N*O, K] @ g [N*O, Cout], Gemm transA": ("Gemm", {"transA": 1}, [[n, k], [n, c]], [k, c]),
        "weight grad cols [K, N*O] @ g [N*O, Cout]": ("MatMul", {}, [[k, n], [n, c]], [k, c]),
    }


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


def iree_ms(model) -> float:
    """IREE's time of ``model`` at one worker (ms, the process's CPU time: IREE's worker is another thread),
    compiled as bridge.compile does for the host."""
    import numpy as np

    from repros.compiled_conv_im2col import iree_run
    from repros.iree_adam_after_matmul import best_ms

    rng = np.random.default_rng(0)
    feed = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}
    run = iree_run(model, feed)
    return best_ms(lambda: run(None), 30)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repros.* when run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's bridge
    from bridge.training.runtime_onnx_mlir import keep_freed_memory
    from repros.onnx_mlir_slow_ops import build, compare

    keep_freed_memory()  # as bridge's onnx-mlir session runs
    arguments = sys.argv[1:]
    with_iree = "--iree" in arguments
    keep = next((a for a in arguments if a != "--iree"), None)
    for conv, shape in CONVS.items():
        batch, in_channels, side, out_channels = shape
        print(f"{conv} ({batch}x{in_channels}x{side}x{side} -> {out_channels} channels): "
              f"onnxruntime's Conv {onnxruntime_conv_ms(*shape):.3f} ms", flush=True)
        for name, (op, attributes, shapes, output) in cases(*shape).items():
            model = build(op, attributes, shapes, output)
            if with_iree:
                print(f"  {name}: IREE {iree_ms(model):.3f} ms", flush=True)
                continue
            with tempfile.TemporaryDirectory() as scratch:
                folder = tempfile.mkdtemp(dir=keep) if keep else scratch
                mlir_ms, ort_ms, error = compare(model, folder, FLAGS)
            print(f"  {name}: onnx-mlir {mlir_ms:.3f} ms, onnxruntime {ort_ms:.3f} ms ({mlir_ms / ort_ms:.1f}x), "
                  f"outputs differ by {error:.1e} of their scale", flush=True)
