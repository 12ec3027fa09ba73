"""Index updates: ScatterElements and ScatterND as dense one-hot arithmetic.

Every update is compared with every position it may land on: ``hit[p, j] = (index[j] == p)``
over the scattered axis (ScatterElements) or over the flattened indexed leading dims
(ScatterND). Each reduction is then a masked reduction over the updates (``none``/``add``: a
sum, ``mul``: a product, ``max``/``min``: an amax/amin) combined with the data, so the traced
graph holds no Scatter at all: onnx-mlir's ScatterND has no reduction and its ScatterElements
no duplicate indices, and autograd's backward of these formulas is a masked sum too (the
gradient of ``data`` is ``dy`` where no update lands, that of each update the ``dy`` at its
position). Duplicate indices under ``reduction="none"`` (whose order ONNX leaves undefined)
keep the last update, as onnxruntime does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ....errors import ShapeError
from ..registry import converter
from .indexing import flat_index
from .reduce import extremum

REDUCTIONS = ("none", "add", "mul", "max", "min")


def _last_hits(hits: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``hits`` keeping, per position, only the last update along ``dim`` that lands on it."""
    counts = hits.to(dtype)
    later = counts.flip(dim).cumsum(dim).flip(dim) - counts
    return hits & (later == 0)


def _combine(ctx, data: torch.Tensor, hits: torch.Tensor, updates: torch.Tensor, dim: int) -> torch.Tensor:
    """``data`` with the broadcast ``updates`` reduced over ``dim`` where ``hits`` says they land."""
    reduction = ctx.attr("reduction", "none")
    if reduction not in REDUCTIONS:
        raise ctx.unsupported(f"reduction='{reduction}'")
    landed = hits.any(dim)
    if reduction == "none":
        return torch.where(landed, torch.where(_last_hits(hits, dim, data.dtype), updates, 0).sum(dim), data)
    if reduction == "add":
        return data + torch.where(hits, updates, 0).sum(dim)
    if reduction == "mul":
        return data * torch.where(hits, updates, 1).prod(dim)
    largest = reduction == "max"
    best = extremum(largest)(torch.where(hits, updates, float("-inf") if largest else float("inf")), [dim]).squeeze(dim)
    return torch.where(landed, torch.maximum(data, best) if largest else torch.minimum(data, best), data)


@converter("ScatterElements")
def scatter_elements(ctx, data, indices, updates):
    """``out[..., indices[..., j, ...], ...] (op)= updates[..., j, ...]`` along ``axis``.

    ``indices`` may be smaller than ``data`` in every dim: it is padded with -1 (which lands
    nowhere) to ``data``'s shape outside ``axis``.
    """
    axis = ctx.attr("axis", 0) % data.dim()
    size = data.shape[axis]
    indices = torch.where(indices < 0, indices + size, indices)
    pads = []
    for d in reversed(range(data.dim())):
        same = d == axis or statically_known_true(data.shape[d] == indices.shape[d])
        pads += [0, 0 if same else data.shape[d] - indices.shape[d]]
    if any(isinstance(p, torch.SymInt) for p in pads):
        raise ShapeError(f"ScatterElements node '{ctx.name}': indices {list(indices.shape)} are smaller than data "
                         f"{list(data.shape)} in a symbolic dim; give them the data's size there (or convert with a "
                         "static batch)")
    if any(pads):
        indices, updates = F.pad(indices, pads, value=-1), F.pad(updates, pads, value=0.0)
    index = indices.movedim(axis, -1).unsqueeze(-2)  # [..., 1, J]
    hits = torch.arange(size).unsqueeze(1) == index  # [..., size, J]
    out = _combine(ctx, data.movedim(axis, -1), hits, updates.movedim(axis, -1).unsqueeze(-2), -1)
    return out.movedim(-1, axis)


@converter("ScatterND")
def scatter_nd(ctx, data, indices, updates):
    """``out[indices[j]] (op)= updates[j]`` for each index tuple ``j`` (the last dim of ``indices``
    indexes the leading dims of ``data``)."""
    depth = indices.shape[-1]
    indexed, rest = list(data.shape[:depth]), list(data.shape[depth:])
    positions, count, width = math.prod(indexed), math.prod(indices.shape[:-1]), math.prod(rest)
    flat = flat_index(indices, indexed).reshape(1, count, 1)
    hits = torch.arange(positions).reshape(positions, 1, 1) == flat  # [P, B, 1]
    rows = updates.reshape(1, count, width)
    return _combine(ctx, data.reshape(positions, width), hits, rows, 1).reshape(data.shape)
