"""Resize and Upsample as constant interpolation matrices, one MatMul per resized axis.

Every ONNX Resize mode is separable: output position ``o`` along an axis reads input
positions with fixed weights (one for nearest, two for linear, four for cubic). With static
shapes and scales those weights form a constant matrix ``M[out, in]``, so the op is
``y = M @ x`` along each resized axis. This is exact, needs no Resize (whose onnx-mlir form
has no linear/cubic mode), and autograd's backward is the transposed MatMul ``M^T @ dy``:
repeated reads of one input position (nearest upsampling) accumulate their gradients.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..registry import converter

_ROUND = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


def _source_coords(ctx, coordinate_mode: str, in_len: int, out_len: int, scale: float, dtype=np.float64) -> np.ndarray:
    """ONNX coordinate_transformation_mode: output positions -> positions in the input (in ``dtype``)."""
    x = np.arange(out_len, dtype=dtype)
    scale = dtype(scale)
    if coordinate_mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if coordinate_mode == "half_pixel_symmetric":
        adjustment = out_len / (scale * in_len)
        return dtype(in_len / 2 * (1 - adjustment)) + (x + 0.5) / scale - 0.5
    if coordinate_mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros(out_len, dtype)
    if coordinate_mode == "align_corners":
        return x * (in_len - 1) / (out_len - 1) if out_len > 1 else np.zeros(out_len, dtype)
    if coordinate_mode == "asymmetric":
        return x / scale
    raise ctx.unsupported(f"coordinate_transformation_mode='{coordinate_mode}'")


def _cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic kernel at distances 1+t, t, 1-t, 2-t (taps floor-1 .. floor+2)."""
    d = np.stack([1 + t, t, 1 - t, 2 - t], axis=-1)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


def _antialias_taps(mode: str, source: np.ndarray, scale: float, cubic_a: float) -> tuple[np.ndarray, np.ndarray]:
    """Taps and weights of the linear/cubic kernel stretched by ``1 / scale`` (downsampling with
    ``antialias=1``), normalized to sum 1, as the ONNX reference computes them: the kernel's
    ``n`` taps nearest to the source coordinate, an integer coordinate taking its left pixel."""
    support = 1 if mode == "linear" else 2
    start = int(np.floor(-support / scale) + 1)
    offsets = np.arange(start, 1 - start + 1)
    base = np.floor(source)
    ratio = np.where(source == base, 1.0, source - base)
    base = np.where(source == base, base - 1, base)
    distance = np.abs((offsets[None, :] - ratio[:, None]) * scale)
    if mode == "linear":
        weights = np.clip(1 - distance, 0, 1)
    else:
        a = cubic_a
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
        weights = np.where(distance <= 1, near, np.where(distance < 2, far, 0.0))
    return base[:, None] + offsets, weights / weights.sum(axis=1, keepdims=True)


def interpolation_matrix(ctx, mode: str, coordinate_mode: str, nearest_mode: str, in_len: int, out_len: int,
                         scale: float, cubic_a: float = -0.75, exclude_outside: bool = False,
                         antialias: bool = False) -> np.ndarray:
    """``M[out_len, in_len]`` with ``y = M @ x`` along one axis (float64).

    Nearest picks its index from coordinates computed in float32, as onnxruntime and torch do,
    so that ties (``x.5``) round the same way; interpolation weights are exact (float64).
    ``antialias`` (linear/cubic) stretches the kernel when downsampling.
    """
    rows = np.arange(out_len)[:, None]
    if mode == "nearest":
        if nearest_mode == "simple":  # Resize-10 / Upsample: truncate when upsampling, ceil when downsampling
            nearest_mode = "floor" if scale >= 1 else "ceil"
        if nearest_mode not in _ROUND:
            raise ctx.unsupported(f"nearest_mode='{nearest_mode}'")
        source = _source_coords(ctx, coordinate_mode, in_len, out_len, scale, np.float32)
        taps = _ROUND[nearest_mode](source)[:, None].astype(np.float64)
        weights = np.ones_like(taps)
        return _scatter_taps(rows, taps, weights, out_len, in_len)
    source = _source_coords(ctx, coordinate_mode, in_len, out_len, scale)
    if antialias and scale < 1 and mode in ("linear", "cubic"):
        taps, weights = _antialias_taps(mode, source, scale, cubic_a)
        if exclude_outside:
            weights = np.where((taps >= 0) & (taps < in_len), weights, 0.0)
            weights = weights / weights.sum(axis=1, keepdims=True)
    elif mode == "linear":
        base = np.floor(source)
        t = source - base
        taps = base[:, None] + np.arange(2)
        weights = np.stack([1 - t, t], axis=-1)
    elif mode == "cubic":
        base = np.floor(source)
        taps = base[:, None] + np.arange(-1, 3)
        weights = _cubic_weights(source - base, cubic_a)
        if exclude_outside:
            weights = np.where((taps >= 0) & (taps < in_len), weights, 0.0)
            weights = weights / weights.sum(axis=1, keepdims=True)
    else:
        raise ctx.unsupported(f"mode='{mode}'")
    return _scatter_taps(rows, taps, weights, out_len, in_len)


def _scatter_taps(rows: np.ndarray, taps: np.ndarray, weights: np.ndarray, out_len: int, in_len: int) -> np.ndarray:
    """The matrix of tap weights; taps outside the input read its edge (ONNX's edge padding)."""
    matrix = np.zeros((out_len, in_len))
    np.add.at(matrix, (np.broadcast_to(rows, taps.shape), np.clip(taps, 0, in_len - 1).astype(np.int64)), weights)
    return matrix


def _interpolate(ctx, x: torch.Tensor, out_shape: list[int], scales: list[float], mode: str, coordinate_mode: str,
                 nearest_mode: str, cubic_a: float = -0.75, exclude_outside: bool = False,
                 antialias: bool = False) -> torch.Tensor:
    """Resize ``x`` to ``out_shape`` with one constant-matrix MatMul per axis whose size or grid changes."""
    for axis, (in_len, out_len, scale) in enumerate(zip(x.shape, out_shape, scales, strict=True)):
        if scale == 1 and out_len == in_len:  # every mode maps a unit-scale axis onto itself
            continue
        matrix = interpolation_matrix(ctx, mode, coordinate_mode, nearest_mode, in_len, out_len, scale, cubic_a,
                                      exclude_outside, antialias)
        if out_len == in_len and np.array_equal(matrix, np.eye(in_len)):
            continue
        shape = list(x.shape)
        stacked = x.reshape(math.prod(shape[:axis]), in_len, math.prod(shape[axis + 1:]))
        x = torch.matmul(torch.from_numpy(matrix).to(x.dtype), stacked).reshape(shape[:axis] + [out_len] + shape[axis + 1:])
    return x


def _full(values: list, axes: list[int] | None, rank: int, fill) -> list:
    """Values given for ``axes`` (all axes when None), filled in for the other axes."""
    if axes is None:
        return list(values)
    full = [fill] * rank
    for axis, value in zip(axes, values, strict=True):
        full[axis % rank] = value
    return full


def _sizes_and_scales(ctx, x, scales, sizes) -> tuple[list[int], list[float]]:
    rank, axes = x.dim(), ctx.attr("axes")
    in_shape = list(x.shape)
    if sizes is not None and np.asarray(sizes).size:
        sizes = _full(ctx.ints(sizes), axes, rank, None)
        sizes = [in_shape[i] if s is None else s for i, s in enumerate(sizes)]
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            return sizes, [s / n for s, n in zip(sizes, in_shape, strict=True)]
        chosen = [i for i in range(rank) if axes is None or i in [a % rank for a in axes]]
        ratios = [sizes[i] / in_shape[i] for i in chosen]
        scale = min(ratios) if policy == "not_larger" else max(ratios)
        scales = [scale if i in chosen else 1.0 for i in range(rank)]
        return [int(math.floor(s * n + 0.5)) for s, n in zip(scales, in_shape, strict=True)], scales
    if scales is None or not np.asarray(scales).size:
        raise ctx.unsupported("a Resize without scales or sizes")
    scales = _full([float(s) for s in np.asarray(scales).reshape(-1)], axes, rank, 1.0)
    return _scaled(in_shape, scales), scales


def _scaled(in_shape: list, scales: list[float]) -> list:
    """ONNX output sizes ``floor(in * scale)``; unit-scale dims stay as they are (even symbolic)."""
    return [n if s == 1 else int(math.floor(n * s)) for n, s in zip(in_shape, scales, strict=True)]


@converter("Resize", static=(1, 2, 3))
def resize(ctx, x, roi=None, scales=None, sizes=None):
    if ctx.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        scales, sizes, coordinate_mode, nearest_mode = roi, None, "asymmetric", "simple"
    else:
        coordinate_mode = ctx.attr("coordinate_transformation_mode", "half_pixel")
        nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    mode = ctx.attr("mode", "nearest")
    if coordinate_mode == "tf_crop_and_resize":
        raise ctx.unsupported("coordinate_transformation_mode='tf_crop_and_resize'")
    out_shape, scale_list = _sizes_and_scales(ctx, x, scales, sizes)
    return _interpolate(ctx, x, out_shape, scale_list, mode, coordinate_mode, nearest_mode,
                        ctx.attr("cubic_coeff_a", -0.75), bool(ctx.attr("exclude_outside", 0)),
                        bool(ctx.attr("antialias", 0)))


@converter("Upsample", static=(1,))
def upsample(ctx, x, scales=None):
    scales = [float(s) for s in (ctx.attr("scales") if scales is None else np.asarray(scales).reshape(-1))]
    out_shape = _scaled(list(x.shape), scales)
    return _interpolate(ctx, x, out_shape, scales, ctx.attr("mode", "nearest"), "asymmetric", "simple")
