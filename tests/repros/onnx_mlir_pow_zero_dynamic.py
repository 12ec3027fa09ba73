"""onnx-mlir defect: ``Pow(x, 0)`` of a tensor with a symbolic dim aborts the compiler.

    python tests/repros/onnx_mlir_pow_zero_dynamic.py [out.onnx]

builds ONE Pow (x [batch, 3], exponent a constant 0.0), writes it, and compiles it with
``onnx-mlir --EmitLib -O3`` through bridge.compile: onnx-mlir folds ``x ** 0`` into a constant of ones
of x's shape, takes the symbolic dim's marker (INT64_MIN) as a size and dies (SIGABRT: "cannot create
std::vector larger than max_size()"; in a training graph "'onnx.Constant' op shape inference failed,
SmallVector unable to grow"). The same Pow at a static shape [2, 3], and exponents 1 and 2 at the
symbolic one, compile. onnxruntime runs all of them.

bridge emits it in the backward of GlobalLpPool with p=1 (``d/dx sum|x|**p ... |x|**(p-1)``, p-1 = 0),
so the op-database row GlobalLpPool-1d_p1 fails with a symbolic batch. Not yet avoided: the form that
compiles is no Pow at all for a constant exponent 0 (ones, ``Expand(1, Shape(x))``) or 1 (``x``).
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


def build(dims=("batch", 3), exponent: float = 0.0) -> onnx.ModelProto:
    """``y = x ** exponent``, x of ``dims`` (a str is a symbolic dim)."""
    node = helper.make_node("Pow", ["x", "e"], ["y"], name="pow_zero")
    graph = helper.make_graph([node], "pow_zero_dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))],
                              [numpy_helper.from_array(np.array(exponent, np.float32), "e")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for dims, exponent in ((("batch", 3), 0.0), ((2, 3), 0.0), (("batch", 3), 1.0)):
        print_compile(f"x {list(dims)} ** {exponent}", build(dims, exponent), backend="onnx-mlir")
