"""Reflect, edge and wrap padding as Slice + Concat forms (no ``aten.reflection_pad*``).

torch's ``F.pad`` in these modes traces to ``reflection_padNd`` / ``replication_padNd`` (whose
backward ops have no ONNX form; the core decomposition of the reflect forward is an
``aten.index`` with several index tensors) or, for ``circular``, to a ``copy_`` into an empty
tensor. Written here with ``narrow``, ``flip``, ``expand`` and ``cat`` instead, the forward
exports as Slice / Expand / Concat and autograd's backward as Slice / ReduceSum / Concat
(``slice_scatter`` is lowered in ``slicing.py``), all of which onnx-mlir accepts. Any axis
and any rank can be padded (torch's modes pad only the last 1-3 dims).
"""
from __future__ import annotations

import torch


def pad_axis(x: torch.Tensor, axis: int, begin: int, end: int, mode: str) -> torch.Tensor:
    """``x`` with ``begin`` / ``end`` elements added along ``axis`` in ``mode`` (ONNX Pad's
    reflect / edge / wrap); a negative count removes elements from that side first."""
    if begin < 0:
        x, begin = x.narrow(axis, -begin, x.shape[axis] + begin), 0
    if end < 0:
        x, end = x.narrow(axis, 0, x.shape[axis] + end), 0
    if not begin and not end:
        return x
    if mode == "wrap":
        return _wrap(x, axis, begin, end)
    parts = [_border(x, axis, begin, mode, first=True), x, _border(x, axis, end, mode, first=False)]
    return torch.cat([p for p in parts if p is not None], axis)


def _border(x: torch.Tensor, axis: int, count: int, mode: str, first: bool) -> torch.Tensor | None:
    """The ``count`` elements padded before (``first``) or after ``x`` along ``axis``."""
    if not count:
        return None
    length = x.shape[axis]
    if mode == "edge":
        sizes = list(x.shape)
        sizes[axis] = count
        return x.narrow(axis, 0 if first else length - 1, 1).expand(sizes)
    return x.narrow(axis, 1 if first else length - 1 - count, count).flip(axis)


def _wrap(x: torch.Tensor, axis: int, begin: int, end: int) -> torch.Tensor:
    """Circular padding: the axis repeated enough times, then the wanted window of it."""
    length = x.shape[axis]
    before, after = -(-begin // length), -(-end // length)
    tiled = torch.cat([x] * (before + 1 + after), axis)
    return tiled.narrow(axis, before * length - begin, length + begin + end)
