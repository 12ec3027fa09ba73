"""GridSample (spatial transformers) as dense interpolation weights and one MatMul.

For each output point and each spatial axis, the sampling coordinate gives weights over the
axis's positions: ``W[n, q, p] = sum over taps of weight(tap) * (index(tap) == p)`` (one tap
for nearest, two for linear, four for cubic), where the tap index is mapped by the padding
mode (``border`` clamps it, ``reflection`` reflects it, ``zeros`` leaves it outside, where it
matches no position and so reads 0). The axes' weights multiply into ``W[n, q, P]`` over all
``P`` input positions, and ``y = x[n, c, P] @ W^T``. Indices stay float and are compared, never
cast (onnx-mlir casts only between float types); the gradient reaches ``x`` through the MatMul
and the grid through the tap weights (``floor`` and ``round`` have zero gradient). The steps
follow the ONNX reference: normalized -> pixel coordinates, rounding (nearest), coordinate
padding, then taps with per-tap padding. ``W`` has ``Q * P`` elements per batch entry: meant for
the small feature maps of spatial-transformer and detection heads.
"""
from __future__ import annotations

import math

import torch

from ..registry import converter

_MODES = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}
_TAPS = {"nearest": (0,), "linear": (0, 1), "cubic": (-1, 0, 1, 2)}
_PADDINGS = ("zeros", "border", "reflection")
CUBIC_A = -0.75


def _pixel(g: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """A normalized coordinate in [-1, 1] as a pixel coordinate along an axis of ``size``."""
    return (g + 1) / 2 * (size - 1) if align_corners else ((g + 1) * size - 1) / 2


def _reflect(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``x`` reflected at ``lo`` and ``hi`` until it lies between them."""
    span = hi - lo
    if span == 0:
        return x * 0 + lo
    below = x < lo
    distance = torch.where(below, lo - x, x - hi)
    flips = torch.floor(distance / span)
    rest = distance - flips * span
    even = torch.fmod(flips, 2) == 0
    from_lo, from_hi = lo + rest, hi - rest
    reflected = torch.where(below, torch.where(even, from_lo, from_hi), torch.where(even, from_hi, from_lo))
    return torch.where(below | (x > hi), reflected, x)


def _tap_weights(t: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """The weight of each tap (``_TAPS``) at fraction ``t`` past the floor."""
    if mode == "nearest":
        return [torch.ones_like(t)]
    if mode == "linear":
        return [1 - t, t]

    def near(d):
        return ((CUBIC_A + 2) * d - (CUBIC_A + 3)) * d * d + 1

    def far(d):
        return ((CUBIC_A * d - 5 * CUBIC_A) * d + 8 * CUBIC_A) * d - 4 * CUBIC_A

    return [far(1 + t), near(t), near(1 - t), far(2 - t)]


def _axis_weights(coord: torch.Tensor, size: int, mode: str, padding: str, lo: float, hi: float) -> torch.Tensor:
    """``W[..., p]``: the weight of each position ``p`` of one axis at each coordinate."""
    if padding == "border":
        coord = torch.where((coord < lo) | (coord > hi), coord.clamp(0, size - 1), coord)
    elif padding == "reflection":
        coord = _reflect(coord, lo, hi)
    base = coord if mode == "nearest" else torch.floor(coord)
    positions = torch.arange(size, dtype=coord.dtype)
    total = torch.zeros(list(coord.shape) + [size], dtype=coord.dtype)
    for offset, weight in zip(_TAPS[mode], _tap_weights(coord - base, mode), strict=True):
        index = base + offset
        if padding == "border":
            index = index.clamp(0, size - 1)
        elif padding == "reflection":
            index = _reflect(index, lo, hi)
        total = total + torch.where(index.unsqueeze(-1) == positions, weight.unsqueeze(-1), 0.0)
    return total


@converter("GridSample")
def grid_sample(ctx, x, grid):
    """``y[n, c, q] = sum_p x[n, c, p] * W[n, q, p]`` for 1-D, 2-D and 3-D inputs (``grid[..., 0]``
    indexes the LAST spatial axis, as in torch)."""
    mode = _MODES.get(ctx.attr("mode", "linear" if ctx.opset >= 20 else "bilinear"))
    padding = ctx.attr("padding_mode", "zeros")
    if mode is None or padding not in _PADDINGS:
        raise ctx.unsupported(f"mode='{ctx.attr('mode')}' with padding_mode='{padding}'")
    align_corners = bool(ctx.attr("align_corners", 0))
    batch, channels, sizes = x.shape[0], x.shape[1], list(x.shape[2:])
    out, rank = list(grid.shape[1:-1]), len(sizes)
    points = grid.reshape(batch, math.prod(out), rank)
    weights = None
    for axis, size in enumerate(sizes):
        coord = _pixel(points[..., rank - 1 - axis], size, align_corners)
        if mode == "nearest":
            coord = torch.round(coord)  # half to even, as the ONNX reference and torch
        lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        axis_weights = _axis_weights(coord, size, mode, padding, lo, hi)
        weights = axis_weights if weights is None else (weights.unsqueeze(-1) * axis_weights.unsqueeze(-2)).flatten(2)
    y = torch.matmul(x.reshape(batch, channels, math.prod(sizes)), weights.transpose(1, 2))
    return y.reshape([batch, channels] + out)
