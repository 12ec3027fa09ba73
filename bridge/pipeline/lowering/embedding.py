"""Accumulating scatters (the backward of Gather / embedding / index_select / gather) as dense ops.

autograd writes the gradient of a lookup as ``index_put(zeros, indices, grad, accumulate=True)``
(embedding, index_select, advanced indexing) or ``scatter_add(zeros, dim, index, grad)``
(gather). Their ONNX forms, ScatterND with reduction='add' and ScatterElements with duplicate
indices, are what onnx-mlir rejects, so both are rewritten with a one-hot matrix
``onehot[p, j] = (index[j] == p)`` built from Equal against an arange: repeated indices then sum
their contributions exactly as an accumulating scatter does.
"""
from __future__ import annotations

import math

import torch

from ...errors import LoweringError
from ..targets import product_is_gemm
from . import lowers

aten = torch.ops.aten


def _wrap(index: torch.Tensor, size: int) -> torch.Tensor:
    """Negative indices count from the end (as torch's indexing does)."""
    return torch.where(index < 0, index + size, index)


@lowers(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate=False):
    """``x[indices] (+)= values`` for index tensors on consecutive dims (the others ``None``).

    The indexed dims are flattened into one of size P, the index tensors into one linear index
    of length B; then ``onehot[P, B] @ values[pre, B, post]`` sums the values landing on each
    position.
    """
    used = [d for d, i in enumerate(indices) if i is not None]
    if not used or used != list(range(used[0], used[0] + len(used))):
        raise LoweringError("index_put with index tensors on non-consecutive dims has no dense lowering")
    first, count = used[0], len(used)
    index_tensors = torch.broadcast_tensors(*[indices[d] for d in used])
    wrapped = [_wrap(index, x.shape[d]) for d, index in zip(used, index_tensors, strict=True)]
    linear = wrapped[0]
    for d, index in zip(used[1:], wrapped[1:], strict=True):
        linear = linear * x.shape[d] + index
    pre, post = list(x.shape[:first]), list(x.shape[first + count:])
    positions = math.prod(x.shape[first:first + count])
    batch = linear.numel()
    values = values.expand(pre + list(linear.shape) + post).reshape(math.prod(pre), batch, math.prod(post))
    onehot = torch.arange(positions).unsqueeze(1) == linear.reshape(1, batch)
    if values.dtype.is_floating_point and math.prod(pre) == 1 and product_is_gemm(batch, math.prod(post)):
        # one 2-D product, which long_inner_gemm makes a Gemm
        scattered = torch.mm(onehot.to(values.dtype), values.reshape(batch, math.prod(post))).reshape(x.shape)
    else:
        scattered = torch.matmul(onehot.to(values.dtype), values).reshape(x.shape)
    if accumulate:
        return x + scattered
    hit = onehot.any(1).reshape([1] * first + list(x.shape[first:first + count]) + [1] * len(post))
    return torch.where(hit, scattered, x)


@lowers(aten.scatter_add.default)
def scatter_add(x, dim, index, src):
    """``x`` plus, along ``dim``, every ``src`` element added at its ``index`` (duplicates summed)."""
    dim %= x.dim()
    src = src[tuple(slice(0, n) for n in index.shape)]
    index = _wrap(index, x.shape[dim]).movedim(dim, -1)
    onehot = torch.arange(x.shape[dim]).unsqueeze(1) == index.unsqueeze(-2)  # [..., size, J]
    summed = torch.where(onehot, src.movedim(dim, -1).unsqueeze(-2), 0.0).sum(-1).movedim(-1, dim)
    pad = []
    for d in reversed(range(x.dim())):
        pad += [0, x.shape[d] - summed.shape[d]]
    return x + torch.nn.functional.pad(summed, pad)
