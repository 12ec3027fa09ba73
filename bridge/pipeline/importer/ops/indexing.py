"""N-dimensional indexing: GatherND (the dynamo exporter's form of ``tensor[idx0, idx1]``)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..registry import converter


def flat_index(indices: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """One linear (row-major) position into dims of ``sizes`` per index tuple in the last dim of
    ``indices``; negative indices count from the end of their dim."""
    flat = torch.zeros(indices.shape[:-1], dtype=torch.int64)
    for k, size in enumerate(sizes):
        idx = indices[..., k].to(torch.int64)
        flat = flat * size + torch.where(idx < 0, idx + size, idx)
    return flat


@converter("GatherND")
def gather_nd(ctx, data, indices):
    """``data[b..., i0, i1, ...]`` for each index tuple in the last dim of ``indices``.

    Written as one flat index into the indexed dims and a single ``index_select``, so the
    traced graph (and its backward) has one index tensor.
    """
    batch_dims = ctx.attr("batch_dims", 0)
    depth = indices.shape[-1]
    batch_shape = list(data.shape[:batch_dims])
    indexed = list(data.shape[batch_dims:batch_dims + depth])
    rest = list(data.shape[batch_dims + depth:])
    flat = flat_index(indices, indexed)
    batch = math.prod(batch_shape)
    if batch_dims:
        offsets = torch.arange(batch, dtype=torch.int64).reshape(batch_shape + [1] * (flat.dim() - batch_dims))
        flat = flat + offsets * math.prod(indexed)
    rows = data.reshape([batch * math.prod(indexed)] + rest)
    out = rows.index_select(0, flat.reshape(-1))
    return out.reshape(list(indices.shape[:-1]) + rest)


@converter("ReverseSequence")
def reverse_sequence(ctx, x, lengths):
    """Each batch entry's first ``lengths[b]`` steps along ``time_axis`` reversed, the rest kept:
    one ``gather`` along the time axis with source steps ``where(t < len, len - 1 - t, t)``."""
    time_axis, batch_axis = ctx.attr("time_axis", 0), ctx.attr("batch_axis", 1)
    steps = torch.arange(x.shape[time_axis]).unsqueeze(1)  # [T, 1]
    lengths = lengths.to(torch.int64).reshape(1, lengths.shape[0])  # [1, B]
    source = torch.where(steps < lengths, lengths - 1 - steps, steps)  # [T, B]
    if time_axis > batch_axis:
        source = source.t()
    index = source.reshape(list(source.shape) + [1] * (x.dim() - 2)).expand(x.shape)
    return torch.gather(x, time_axis, index)
