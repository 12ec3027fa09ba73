"""The backward of slicing and selecting (``slice_scatter`` / ``select_scatter``) without a scatter.

Slicing a weight (the legacy exporter splits an LSTM's weight into gates with Slice) makes
autograd write the gradient into zeros with ``slice_scatter``, which has no ONNX form that
onnx-mlir accepts. A unit-step slice is a Concat of the kept parts and the source; any other
step is a Concat of input and source followed by a Gather with a constant permutation.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import lowers

aten = torch.ops.aten


@lowers(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    dim %= x.dim()
    if _whole_axis(x, dim, start, end, step):
        return src
    length = x.shape[dim]
    start, end = _bounds(start, end, step, length)
    if step == 1:
        parts = [x.narrow(dim, 0, start), src, x.narrow(dim, end, length - end)]
        return torch.cat([p for p in parts if not statically_known_true(p.shape[dim] == 0)], dim)  # no guard on a symbolic size
    position = {p: length + k for k, p in enumerate(range(start, end, step))}
    index = torch.tensor([position.get(p, p) for p in range(length)], dtype=torch.int64)
    return torch.cat([x, src], dim).index_select(dim, index)


def _bounds(start, end, step: int, length) -> tuple:
    """``slice(start, end, step).indices(length)`` (with ``end >= start``); a symbolic bound or
    length (a sequence length slicing a position table) stays symbolic: such a slice has a unit
    step and bounds within the axis (the forward's slice already guarded that)."""
    if isinstance(start, torch.SymInt) or isinstance(end, torch.SymInt) or isinstance(length, torch.SymInt):
        start, end = 0 if start is None else start, length if end is None else end
        return start, end if statically_known_true(end <= length) else min(end, length)
    start, end, _ = slice(start, end, step).indices(length)
    return start, max(end, start)


def _whole_axis(x, dim: int, start, end, step: int) -> bool:
    """The slice keeps all of ``dim``, known without fixing a symbolic size (the batch) to a number."""
    return step == 1 and (start is None or statically_known_true(start == 0)) and (
        end is None or statically_known_true(end >= x.shape[dim]))


@lowers(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    dim %= x.dim()
    index %= x.shape[dim]
    return slice_scatter(x, src.unsqueeze(dim), dim, index, index + 1, 1)
