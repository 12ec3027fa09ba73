"""onnx-mlir's dense Conv runs at a small fraction of its own MatMul's speed.

    python tests/repros/onnx_mlir_conv_speed.py [out.onnx] [--mcpu=znver3 ...]

builds one-op graphs, compiles each with ``onnx-mlir --EmitLib -O3`` (and the flags given) and times
it (CPU time, the least of 20 runs) beside onnxruntime at one thread: a 3x3 Conv of small_cnn's second
layer (16x16x16x16 input, 32 output channels), its weight gradient written as a Conv (the output gradient as a 16x16 kernel), and
a MatMul doing the same multiply-adds as the 3x3 Conv (its im2col product, ``[32, 144] @ [144, 4096]``).
onnx-mlir lowers Conv to a loop nest over each output element with the kernel's loops inside, while its
MatMul is tiled and vectorized: the Conv runs 15-18x onnxruntime's time, the MatMul 4-5x, so the
Conv is 6-7x slower than the MatMul doing its work (the weight-gradient Conv 6-9x onnxruntime's).
``out.onnx``: the 3x3 Conv graph is written.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

CASES = {  # name -> (op, input shapes, attributes)
    "conv 3x3": ("Conv", [[16, 16, 16, 16], [32, 16, 3, 3]], {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}),
    "conv as weight gradient": ("Conv", [[16, 16, 16, 16], [32, 16, 16, 16]], {"pads": [1, 1, 1, 1], "kernel_shape": [16, 16]}),
    "matmul, same work as conv 3x3": ("MatMul", [[32, 144], [144, 4096]], {}),
}


def build(op: str, shapes: list[list[int]], attributes: dict) -> onnx.ModelProto:
    """One ``op`` node of float32 graph inputs ``a``, ``b``; output ``y``."""
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in zip("ab", shapes, strict=True)]
    node = helper.make_node(op, ["a", "b"], ["y"], **attributes)
    graph = helper.make_graph([node], op.lower(), inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    onnx.checker.check_model(model, full_check=True)
    return model


def best_ms(run, feed: list[np.ndarray], repeats: int = 20) -> float:
    """Milliseconds of CPU time of this process (one thread runs), the least of ``repeats`` runs: on a loaded
    machine wall time counts the waits for a core."""
    run(feed)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run(feed)
        times.append(time.process_time() - start)
    return min(times) * 1e3


def main() -> None:
    import onnxruntime as ort

    home = Path(os.environ.get("ONNX_MLIR_HOME", "/work/shared/onnx-mlir/install"))
    sys.path.append(str(home / "lib"))
    from PyRuntime import OMExecutionSession

    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    for path in [a for a in sys.argv[1:] if a.endswith(".onnx")]:
        onnx.save(build(*CASES["conv 3x3"]), path)
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    for index, (name, (op, shapes, attributes)) in enumerate(CASES.items()):
        model = build(op, shapes, attributes)
        feed = [rng.standard_normal(shape, np.float32) for shape in shapes]
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / f"case{index}.onnx"  # a library name of its own: dlopen reuses a loaded name
            onnx.save(model, str(path))
            subprocess.run([str(home / "bin" / "onnx-mlir"), "--EmitLib", "-O3", *flags, str(path)], check=True,
                           capture_output=True)
            compiled = OMExecutionSession(str(path.with_suffix(".so")))
            mlir = best_ms(compiled.run, feed)
            expected = compiled.run(feed)[0]
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        reference = session.run(None, {"a": feed[0], "b": feed[1]})[0]
        ms = best_ms(lambda f, s=session: s.run(None, {"a": f[0], "b": f[1]}), feed)
        error = float(np.abs(expected - reference).max() / np.abs(reference).max())
        print(f"{name}: onnx-mlir {mlir:.2f} ms, onnxruntime (1 thread) {ms:.2f} ms, "
              f"ratio {mlir / ms:.1f}x; max difference {error:.1e} of the output's scale")


if __name__ == "__main__":
    main()
