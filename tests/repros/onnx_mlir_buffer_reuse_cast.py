"""onnx-mlir defect: ``--enable-krnl-buffer-reuse`` gives a Cast's result its input's buffer, of another element type.

    python tests/repros/onnx_mlir_buffer_reuse_cast.py [out.onnx]

builds the form every bridge Adam step has: the float32 ``lr`` cast to float64 for the bias-corrected step
(``Cast(lr, to=DOUBLE)``, then a Mul by a float64 constant), and compiles it with ``onnx-mlir --EmitLib -O3``
through bridge.compile, with and without ``--enable-krnl-buffer-reuse``. With it onnx-mlir reuses the buffer of
an elementwise op's input that has one reader, checking the shapes but not the element types, so the Cast
stores float64 values into a float32 buffer and the compile fails ("'krnl.store' op failed to verify that
type of 'value' matches element type of 'memref'"). A float32 -> float64 Cast of any one-reader value does the
same (mobilenet_v3_small's BatchNorm means). Without the flag it compiles. bridge does not pass the flag.
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

BUFFER_REUSE = "--enable-krnl-buffer-reuse"


def build(shape: tuple[int, ...] = ()) -> onnx.ModelProto:
    """``y = float64(lr) * 0.5``, ``lr`` a float32 input of ``shape`` (a scalar, as bridge's ``lr``)."""
    nodes = [helper.make_node("Cast", ["lr"], ["lr_double"], to=TensorProto.DOUBLE, name="lr_to_double"),
             helper.make_node("Mul", ["lr_double", "half"], ["y"], name="scaled")]
    graph = helper.make_graph(nodes, "buffer_reuse_cast", [helper.make_tensor_value_info("lr", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, list(shape))],
                              [numpy_helper.from_array(np.array(0.5, np.float64), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for flags in ((), (BUFFER_REUSE,)):
        print_compile(f"onnx-mlir --EmitLib -O3 {' '.join(flags)}", build(), backend="onnx-mlir", extra_args=flags)
