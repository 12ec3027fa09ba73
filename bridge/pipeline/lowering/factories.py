"""Tensor factories that only the C++ side of autograd creates.

``1 - t`` written in a C++ derivative formula (atanh's ``1 / (1 - x^2)``) is ATen's
``operator-(Scalar, Tensor)``: ``empty_like(t).fill_(1).sub_(t)``, which traces as
``empty_permuted`` + ``copy_`` + ``sub_``. An empty tensor has no defined contents, so
``empty_permuted`` becomes ``empty`` (emitted as a zero constant) of the same shape and
dtype: the layout permutation does not exist in ONNX.
"""
from __future__ import annotations

import torch

from . import lowers

aten = torch.ops.aten


@lowers(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    return aten.empty.memory_format(size, dtype=dtype, device=device)
