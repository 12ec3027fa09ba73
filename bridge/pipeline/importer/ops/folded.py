"""Ops whose output SIZE depends on input values: NonZero, Compress, Unique.

A training graph has static shapes (or a symbolic batch), so these convert only where the
values that decide the size are known before the model runs (constants, or values folded from
them at import): the op is then computed once, in numpy. Otherwise the interpreter raises a
``ShapeError`` naming the node and the input (these inputs are ``static``).
"""
from __future__ import annotations

import numpy as np
import torch

from ..registry import converter


@converter("NonZero", static=(0,))
def non_zero(ctx, x):
    """The indices of the non-zero elements, ``[rank, count]`` (row-major order)."""
    return np.asarray(np.nonzero(np.asarray(x)), dtype=np.int64).reshape(np.ndim(x), -1)


@converter("Compress", static=(1,))
def compress(ctx, x, condition):
    """The slices of ``x`` along ``axis`` (of the flattened ``x`` without one) where ``condition``."""
    axis = ctx.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    kept = np.nonzero(np.asarray(condition).reshape(-1))[0]
    return torch.index_select(x, axis % x.dim(), torch.from_numpy(kept.astype(np.int64)))


@converter("Unique", static=(0,))
def unique(ctx, x):
    """Unique values (of the flattened ``x``, or slices along ``axis``) with their first indices,
    inverse indices and counts; ``sorted=0`` keeps the order of first occurrence."""
    x, axis = np.asarray(x), ctx.attr("axis")
    values, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True,
                                               axis=axis)
    inverse = inverse.reshape(-1)
    if not ctx.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], np.argsort(order)[inverse]
    return values, *(np.asarray(v, dtype=np.int64) for v in (first, inverse, counts))
