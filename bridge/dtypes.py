"""Element types: ONE table of the ONNX element types bridge computes in, and its torch and numpy names.

ONNX ``TensorProto`` enums and numpy dtypes are available without torch (``ONNX_TO_NUMPY``);
the torch-keyed tables (``TORCH_TO_ONNX``, ``TORCH_TO_NUMPY``, ``ONNX_TO_TORCH``,
``NUMPY_TO_TORCH``) are built on first use (PEP 562 ``__getattr__``), so that reading or
running a training graph never imports torch. numpy has no bfloat16: its dtype is ml_dtypes'
(what ``onnx.helper.tensor_dtype_to_np_dtype`` returns).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
from onnx import TensorProto, helper

# ONNX element type -> torch dtype name (``getattr(torch, name)``)
_TORCH_NAMES = {
    TensorProto.FLOAT: "float32",
    TensorProto.DOUBLE: "float64",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT64: "int64",
    TensorProto.INT32: "int32",
    TensorProto.INT16: "int16",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.BOOL: "bool",
}

ONNX_TO_NUMPY: dict[int, np.dtype] = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)) for t in _TORCH_NAMES}


@functools.cache
def _torch_tables() -> dict[str, dict]:
    import torch

    onnx_to_torch = {t: getattr(torch, name) for t, name in _TORCH_NAMES.items()}
    return {
        "ONNX_TO_TORCH": onnx_to_torch,
        "TORCH_TO_ONNX": {d: t for t, d in onnx_to_torch.items()},
        "TORCH_TO_NUMPY": {d: ONNX_TO_NUMPY[t] for t, d in onnx_to_torch.items()},
        "NUMPY_TO_TORCH": {ONNX_TO_NUMPY[t]: d for t, d in onnx_to_torch.items()},
    }


def __getattr__(name: str) -> Any:
    """``TORCH_TO_ONNX``, ``TORCH_TO_NUMPY``, ``ONNX_TO_TORCH``, ``NUMPY_TO_TORCH``: built (importing torch) on first use."""
    tables = _torch_tables() if name in ("ONNX_TO_TORCH", "TORCH_TO_ONNX", "TORCH_TO_NUMPY", "NUMPY_TO_TORCH") else {}
    if name not in tables:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return tables[name]
