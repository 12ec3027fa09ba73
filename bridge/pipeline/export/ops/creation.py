"""Tensor factories: full, zeros/ones_like, scalar_tensor, arange. Shapes are static here, so
these become constants."""
from __future__ import annotations

import numpy as np
import torch

from ....dtypes import TORCH_TO_NUMPY
from ..builder import Value, emits, is_static

aten = torch.ops.aten


def _filled(b, node, value):
    val = node.meta["val"]
    if isinstance(value, (Value, torch.SymInt, torch.SymFloat)):  # a symbolic size as data (e.g. a sequence length)
        fill = b.operand(value, val.dtype)
        return fill if val.dim() == 0 else b.op("Expand", fill, b.shape_tensor(list(val.shape)))
    if not is_static(val.shape):
        return b.op("Expand", b.scalar(value, val.dtype), b.shape_tensor(list(val.shape)))
    return b.const(np.full([int(d) for d in val.shape], value, dtype=TORCH_TO_NUMPY[val.dtype]))


@emits(aten.full.default)
def full(b, node, size, fill_value, **_):
    return _filled(b, node, fill_value)


@emits(aten.full_like.default)
def full_like(b, node, x, fill_value, **_):
    return _filled(b, node, fill_value)


@emits(aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default)
def zeros(b, node, *_, **__):
    return _filled(b, node, 0)


@emits(aten.ones_like.default, aten.ones.default, aten.new_ones.default)
def ones(b, node, *_, **__):
    return _filled(b, node, 1)


@emits(aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default)
def empty(b, node, *_, **__):
    return _filled(b, node, 0)


@emits(aten.scalar_tensor.default)
def scalar_tensor(b, node, value, **_):
    return _filled(b, node, value)


@emits(aten.arange.start_step, aten.arange.default, aten.arange.start)
def arange(b, node, *args, **kwargs):
    """A constant, or ONNX Range when a bound is a symbolic size (e.g. positions 0..batch)."""
    val = node.meta["val"]
    bounds = [a for a in args if isinstance(a, (int, float, Value, torch.SymInt))]
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else (bounds + [1])[:3]
    if is_static([start, end, step]):
        return b.const(np.arange(start, end, step, dtype=TORCH_TO_NUMPY[val.dtype]))
    start, end, step = (b.operand(v, val.dtype) for v in (start, end, step))
    return b.op("Range", start, end, step)
