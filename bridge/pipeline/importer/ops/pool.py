"""Pooling: MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, GlobalLpPool (1-D, 2-D, 3-D).

Pads that torch cannot take (asymmetric, or more than half the window) become an explicit
pad before the op (``-inf`` for MaxPool, zeros for AveragePool, whose divisor is then
corrected to the ONNX count). The output is cropped to the ONNX size, in which a ceil_mode
window that starts in the right padding is dropped.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ....geometry import avg_pool_divisor
from ..registry import converter
from .conv import forward_pads, spatial_attrs, split_pads
from .reduce import lp_norm

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _onnx_sizes(sizes, kernel, strides, dilations, begins, ends, ceil_mode: bool) -> list[int]:
    out = []
    for size, k, s, d, b, e in zip(sizes, kernel, strides, dilations, begins, ends, strict=True):
        span = size + b + e - d * (k - 1) - 1
        count = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (count - 1) * s >= size + b:
            count -= 1
        out.append(count)
    return out


def _crop(y: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    for axis, size in enumerate(sizes):
        if y.shape[axis + 2] != size:
            y = y.narrow(axis + 2, 0, size)
    return y


def _window(ctx, x):
    rank = x.dim() - 2
    kernel = list(ctx.attr("kernel_shape"))
    strides, dilations = spatial_attrs(ctx, rank)
    begins, ends = forward_pads(ctx, x.shape[2:], kernel, strides, dilations)
    return rank, kernel, strides, dilations, begins, ends


@converter("MaxPool")
def convert_max_pool(ctx, x):
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise ctx.unsupported("the Indices output (onnx-mlir's MaxPool has a single output)")
    rank, kernel, strides, dilations, begins, ends = _window(ctx, x)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    sizes = _onnx_sizes(x.shape[2:], kernel, strides, dilations, begins, ends, ceil_mode)
    limits = [(d * (k - 1) + 1) // 2 for k, d in zip(kernel, dilations, strict=True)]
    padded, padding = split_pads(x, begins, ends, float("-inf"), limits)
    y = _MAX_POOL[rank](padded, kernel, strides, padding, dilations, ceil_mode=ceil_mode)
    return _crop(y, sizes)


@converter("AveragePool")
def average_pool(ctx, x):
    rank, kernel, strides, dilations, begins, ends = _window(ctx, x)
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    include_pad = bool(ctx.attr("count_include_pad", 0))
    sizes = _onnx_sizes(x.shape[2:], kernel, strides, dilations, begins, ends, ceil_mode)
    if any(d != 1 for d in dilations):
        return _dilated_average(x, kernel, strides, dilations, begins, ends, sizes, include_pad)
    limits = [k // 2 for k in kernel]
    padded, padding = split_pads(x, begins, ends, 0.0, limits)
    explicit = list(padded.shape[2:]) != list(x.shape[2:])
    y = _AVG_POOL[rank](padded, kernel, strides, padding, ceil_mode=ceil_mode, count_include_pad=include_pad or explicit)
    y = _crop(y, sizes)
    if explicit and not include_pad:
        # torch divided by the window inside the padded input; ONNX divides by the valid elements
        counted = avg_pool_divisor(padded.shape[2:], sizes, kernel, strides, padding, ceil_mode, True, None)
        valid = avg_pool_divisor(x.shape[2:], sizes, kernel, strides, begins, ceil_mode, False, None)
        y = y * torch.from_numpy(np.asarray(counted / valid)).to(y.dtype)
    return y


def _window_sum(x, kernel, strides, dilations, sizes):
    """The sum over each dilated window of a (padded) tensor or array: one strided slice per
    spatial axis and kernel offset (torch's average pool has no dilation)."""
    windows = []
    for offsets in itertools.product(*(range(k) for k in kernel)):
        window = x
        for axis, (o, n, s, d) in enumerate(zip(offsets, sizes, strides, dilations, strict=True), start=2):
            window = _strided(window, axis, o * d, o * d + (n - 1) * s + 1, s)
        windows.append(window)
    return sum(windows[1:], windows[0])


def _strided(x, axis: int, start: int, end: int, step: int):
    if isinstance(x, np.ndarray):
        return x[(slice(None),) * axis + (slice(start, end, step),)]
    return torch.ops.aten.slice(x, axis, start, end, step)


def _dilated_average(x, kernel, strides, dilations, begins, ends, sizes, include_pad: bool):
    """AveragePool with dilations: window sums of the zero-padded input divided by the number of
    input (or, with ``count_include_pad``, input and pad) elements in each window."""
    spatial = list(x.shape[2:])
    extra = [max(0, (n - 1) * s + d * (k - 1) + 1 - (size + b + e))  # windows that ceil_mode adds
             for n, s, d, k, size, b, e in zip(sizes, strides, dilations, kernel, spatial, begins, ends, strict=True)]
    ends_all = [e + a for e, a in zip(ends, extra, strict=True)]
    padded = F.pad(x, [p for b, e in zip(reversed(begins), reversed(ends_all), strict=True) for p in (b, e)])
    batch_free = [(0, 0), (0, 0)]
    inside = np.ones([1, 1] + spatial)
    if include_pad:  # pads count, the windows that ceil_mode adds do not
        inside = np.pad(inside, batch_free + list(zip(begins, ends, strict=True)), constant_values=1)
        outer = [(0, a) for a in extra]
    else:
        outer = [(b, e + a) for b, e, a in zip(begins, ends, extra, strict=True)]
    divisor = _window_sum(np.pad(inside, batch_free + outer), kernel, strides, dilations, sizes)
    return _window_sum(padded, kernel, strides, dilations, sizes) / torch.from_numpy(divisor).to(x.dtype)


@converter("GlobalAveragePool")
def global_average_pool(ctx, x):
    return x.mean(dim=list(range(2, x.dim())), keepdim=True)


@converter("GlobalLpPool")
def global_lp_pool(ctx, x):
    """``(sum |x|^p) ** (1/p)`` over the whole plane (``p`` defaults to 2): ``lp_norm``, whose
    gradient at a plane of zeros is 0, as torch's ``lp_pool``. ``p=1`` is a plain sum of ``|x|``:
    no ``Pow(x, 0)`` in the backward (onnx-mlir aborts on one with a symbolic dim,
    tests/repros/onnx_mlir_pow_zero_dynamic.py)."""
    p = ctx.attr("p", 2)
    if p < 1:
        raise ctx.unsupported(f"p={p} (the p-norm needs p >= 1)")
    return lp_norm(x, list(range(2, x.dim())), p)


@converter("GlobalMaxPool")
def global_max_pool(ctx, x):
    """A max pool over the whole plane: MaxPool forward, first-maximum gradient (no amax tie
    counting, whose int casts onnx-mlir rejects)."""
    return _MAX_POOL[x.dim() - 2](x, list(x.shape[2:]))
