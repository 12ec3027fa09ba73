"""Reductions' backward: ``cumprod`` (from ``prod``'s gradient) without Log or a loop.

torch's ``prod`` backward, traced, takes its zero-safe path (``prod_safe_zeros_backward``):
the gradient of ``x_i`` is the product of every OTHER element, built from an exclusive
``cumprod`` from each side. This is exact with zeros (one zero: only its own position gets a
non-zero gradient; two: all gradients are zero), where ``prod / x`` divides by zero and
``exp(cumsum(log|x|))`` loses the sign and precision. ONNX has no CumProd, so ``cumprod`` of
a length-``n`` axis is a ``ReduceProd`` over a new axis of a ``[n, n]`` lower-triangular
selection: ``y_i = prod_j where(j <= i, x_j, 1)`` (``n^2`` elements: meant for the small
reduced axes of a model, no better form exists in standard ONNX without a Loop).
"""
from __future__ import annotations

import torch

from . import lowers

aten = torch.ops.aten


@lowers(aten.cumprod.default)
def cumprod(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.cumprod(x, dim)`` as one ``prod`` over a lower-triangular selection of ``x``."""
    if dtype is not None:
        x = x.to(dtype)
    if x.dim() == 0:
        return x
    dim %= x.dim()
    length = x.shape[dim]
    # keep[i, j] = j <= i, shaped [n, n, 1, ...] to broadcast over the dims after ``dim``
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    keep = keep.reshape([length, length] + [1] * (x.dim() - dim - 1))
    selected = torch.where(keep, x.unsqueeze(dim), torch.ones((), dtype=x.dtype))
    return torch.prod(selected, dim + 1)
