"""A Conv as im2col + MatMul (``dense_conv_as_matmul``) in onnx-mlir and IREE, against onnxruntime's Conv.

    python tests/repros/compiled_conv_im2col.py [out.onnx]

builds the forward of small_cnn's second Conv (benchmarks/models.py: batch 16, 16 -> 32 channels, 3x3, pads 1,
16x16) node for node as the ``onnx-mlir`` and ``iree`` targets emit it: the input moved channels-first
(``Transpose``), padded, nine shifted ``Slice``s stacked by one ``Concat`` into the ``[C * 9, N * H * W]``
columns, one ``MatMul`` by the ``[Cout, C * 9]`` weight, and the result moved back. It times that graph
compiled by onnx-mlir (``--EmitLib -O3 --mcpu=native``) and by IREE (bridge.compile's flags, host CPU, one
worker), and in onnxruntime, beside onnxruntime's own ``Conv`` of the same shapes (what onnxruntime's step
runs): CPU time, the least of ``REPEATS`` calls, one thread each. onnx-mlir runs twice: under glibc's malloc
defaults, where each call page-faults the columns' buffers anew, then with freed memory kept for reuse as
bridge's onnx-mlir session sets it (``keep_freed_memory``). All agree to float32 summation order.

onnxruntime's Conv does the im2col inside its kernel; each compiler's MatMul alone already takes longer
than that whole Conv, and the column copies add to it, so neither compiled step reaches onnxruntime's on a
dense CNN (small_cnn, resnet18) while its Convs are dense. The direct Conv is slower still in both
(``onnx_mlir_conv_speed.py``; IREE: docs/notes/onnx-mlir-iree-investigations.md, section 8).
``out.onnx``: the im2col graph is written.
"""
from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

BATCH, CHANNELS, SIDE, OUT_CHANNELS = 16, 16, 16, 32
REPEATS = 30


def int64(name: str, values: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def im2col_graph() -> onnx.ModelProto:
    """The Conv's forward as the MatMul targets emit it: ``y = W [Cout, C*9] @ columns [C*9, N*H*W]``."""
    columns = BATCH * SIDE * SIDE
    nodes = [helper.make_node("Transpose", ["x"], ["x_cn"], perm=[1, 0, 2, 3]),
             helper.make_node("Pad", ["x_cn", "pads"], ["padded"])]
    constants = [int64("pads", [0, 0, 1, 1, 0, 0, 1, 1]), int64("axes", [2, 3]),
                 int64("window", [CHANNELS, 1, BATCH, SIDE, SIDE]), int64("columns_shape", [CHANNELS * 9, columns]),
                 int64("weight_shape", [OUT_CHANNELS, CHANNELS * 9]), int64("out_shape", [OUT_CHANNELS, BATCH, SIDE, SIDE])]
    windows = []
    for row in range(3):
        for column in range(3):
            name = f"window_{row}{column}"
            constants += [int64(f"{name}_starts", [row, column]), int64(f"{name}_ends", [row + SIDE, column + SIDE])]
            nodes += [helper.make_node("Slice", ["padded", f"{name}_starts", f"{name}_ends", "axes"], [f"{name}_slice"]),
                      helper.make_node("Reshape", [f"{name}_slice", "window"], [name])]
            windows.append(name)
    nodes += [helper.make_node("Concat", windows, ["stacked"], axis=1),
              helper.make_node("Reshape", ["stacked", "columns_shape"], ["columns"]),
              helper.make_node("Reshape", ["w", "weight_shape"], ["w_rows"]),
              helper.make_node("MatMul", ["w_rows", "columns"], ["product"]),
              helper.make_node("Reshape", ["product", "out_shape"], ["y_cn"]),
              helper.make_node("Transpose", ["y_cn"], ["y"], perm=[1, 0, 2, 3])]
    return _model(nodes, constants)


def conv_graph() -> onnx.ModelProto:
    """The same Conv as one ONNX ``Conv``."""
    return _model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])], [])


def _model(nodes: list[onnx.NodeProto], constants: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "conv", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, CHANNELS, SIDE, SIDE]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [OUT_CHANNELS, CHANNELS, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, OUT_CHANNELS, SIDE, SIDE])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def onnxruntime_run(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda feed: session.run(None, feed)[0]


def onnx_mlir_run(model: onnx.ModelProto, folder: str):
    from bridge.training.runtime_onnx_mlir import _execution_session_class
    from repros.onnx_mlir_defects import compile_as_is

    session = _execution_session_class()(compile_as_is(model, folder, ("--mcpu=native",)), tag="NONE")
    return lambda feed: session.run([feed["x"], feed["w"]])[0]


def iree_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]):
    import iree.compiler.tools as iree_tools
    import iree.runtime

    from bridge.tools.compile import _IREE_FLAGS, to_mlir
    from bridge.training.runtime_iree import IreeTrainingSession

    iree.runtime.flags.parse_flags("--task_topology_max_group_count=1")
    session = IreeTrainingSession(iree_tools.compile_str(to_mlir(model), input_type="onnx", target_backends=["llvm-cpu"],
                                                         extra_args=[*_IREE_FLAGS, "--iree-llvmcpu-target-cpu=host"]), {})
    on_device = [iree.runtime.asdevicearray(session._config.device, feed[name]) for name in session.input_names]
    return lambda _: np.asarray(session._function(*on_device))  # inputs already in IREE buffers


def main() -> None:
    from bridge.training.runtime_onnx_mlir import keep_freed_memory
    from repros.iree_adam_after_matmul import best_ms

    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal([BATCH, CHANNELS, SIDE, SIDE]).astype(np.float32),
            "w": rng.standard_normal([OUT_CHANNELS, CHANNELS, 3, 3]).astype(np.float32)}
    im2col = im2col_graph()
    if len(sys.argv) > 1:
        onnx.save(im2col, sys.argv[1])
    reference = onnxruntime_run(conv_graph())
    want = reference(feed)

    def report(name: str, run) -> None:
        error = float(np.abs(run(feed) - want).max() / np.abs(want).max())
        print(f"{name}: {best_ms(functools.partial(run, feed), REPEATS):.3f} ms CPU, "
              f"differs from onnxruntime's Conv by {error:.1e} of its scale")

    with tempfile.TemporaryDirectory() as folder:  # first: other runtimes' frees move glibc's thresholds
        onnx_mlir = onnx_mlir_run(im2col, folder)
        report("onnx-mlir im2col graph, glibc's malloc defaults", onnx_mlir)
        keep_freed_memory()
        report("onnx-mlir im2col graph, freed memory kept", onnx_mlir)
    report("onnxruntime Conv", reference)
    report("onnxruntime im2col graph", onnxruntime_run(im2col))
    report("IREE im2col graph", iree_run(im2col, feed))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repros.* when run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's bridge
    main()
