"""Pooling backward (and the pooling forms that ONNX pooling ops cannot express).

No ScatterElements, ConvTranspose or MaxPool Indices output is needed: max pooling's scatter
back to the input is ``conv.scatter_windows`` (col2im: per kernel offset, a shift on the output
grid, then the stride phases interleaved), average pooling's the input gradient of a Conv with
a constant ones weight (``conv.input_grad``, faster than the scatter in onnxruntime):

* max pooling, channels-last (so that each strided slice copies channel vectors, not single
  floats): the window elements are strided slices of the ``-inf``-padded forward
  input, one per kernel offset (``conv.window_slices``); their elementwise Max is the pooled
  value; offset by offset, ``grad * where(first, 1, 0)``, ``first`` true where the window's
  maximum is seen for the first time, so only the FIRST maximum of a window gets it, as torch
  does (no ArgMax); each offset's share is scattered back.
* average pooling: ``grad / divisor`` (a constant computed with torch's divisor rule:
  count_include_pad, ceil_mode, divisor_override), scattered by a Conv with a ones weight.
  Forward windows that ceil_mode adds (or a divisor_override) become a sum Conv divided
  by the same constant; other average pools stay ``AveragePool``.
* adaptive average pooling: per spatial dim, a constant averaging matrix ``A [O, L]``
  (row ``i`` averages ``floor(i*L/O) .. ceil((i+1)*L/O)``); forward ``x @ A^T``,
  backward ``g @ A``, one spatial dim at a time.

Tiled windows (kernel == stride, no padding or dilation: ``MaxPool2d(2)``; ``_tiled``) take
full-resolution forms instead, faster in onnxruntime (docs/lowerings/conv_pool.md):

* tiled max pooling: ``pooled = MaxPool(x)`` copied back over each window (``_upsample``);
  ``miss = Ceil(pooled - x)`` is 0 at a window's maxima and >= 1 elsewhere; ``key =
  priority - miss``, the priority ``(K - row-major offset) / scale`` (``scale`` a power of two
  > K), is positive at the maxima only; ``best = MaxPool(key)`` is the first maximum's key, and
  ``Relu(key - (best - 1/scale))`` is exactly ``1/scale`` there and 0 elsewhere: times the
  upsampled ``scale * grad``, the first maximum gets the gradient, as torch routes it. Only
  arithmetic on same-shape tensors: onnxruntime's Where is slow on an irregular mask, and its
  broadcasts and Transposes over a window axis of 2 elements go element by element.
* tiled average pooling: ``grad / divisor`` upsampled.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch

from ...geometry import avg_pool_divisor, per_dim, pooled_size
from . import lowers
from .conv import constant, fit_spatial, input_grad, scatter_windows, to_channels_last, window_slices

aten = torch.ops.aten


def _per_rank(ops_by_rank: dict[int, torch._ops.OpOverload]):
    """Register ``fn(rank, *args)`` as the lowering of each op, with its spatial rank bound."""

    def register(fn):
        for rank, op in ops_by_rank.items():
            lowers(op)(functools.partial(fn, rank))
        return fn

    return register


def _pool_args(rank: int, kernel_size, stride, padding, dilation=(1,)) -> tuple[list[int], ...]:
    kernel = per_dim(kernel_size, rank)
    return kernel, per_dim(stride, rank) if stride else kernel, per_dim(padding, rank), per_dim(dilation, rank)


def _channels_first(x: torch.Tensor, rank: int) -> torch.Tensor:
    """``[*, C, L...]`` (batched or not) as ``[N, C, L...]``."""
    return x if x.dim() == rank + 2 else aten.unsqueeze.default(x, 0)


_MAX_POOL = {2: aten.max_pool2d_with_indices.default, 3: aten.max_pool3d_with_indices.default}


@_per_rank({2: aten.max_pool2d_with_indices_backward.default, 3: aten.max_pool3d_with_indices_backward.default})
def max_pool_backward(rank, grad_output, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """Gradient of max pooling from the forward input (the Indices output is never used)."""
    kernel, stride, padding, dilation = _pool_args(rank, kernel_size, stride, padding, dilation)
    unbatched = x.dim() == rank + 1
    x, grad_output = _channels_first(x, rank), _channels_first(grad_output, rank)
    sizes, outputs = list(x.shape[2:]), list(grad_output.shape[2:])
    if _tiled(kernel, stride, padding, dilation, sizes, outputs):
        grad_input = fit_spatial(_max_pool_backward_tiled(grad_output, _crop(x, kernel, outputs), kernel), sizes)
    else:
        # channels-last: each window's strided slices copy whole channel vectors, not single floats
        windows = window_slices(to_channels_last(x), kernel, stride, padding, dilation, outputs, float("-inf"), first=1)
        routed = _route_to_first_max(windows, to_channels_last(grad_output))
        grad_input = scatter_windows(routed, sizes, kernel, stride, padding, dilation, channels_last=True)
        grad_input = aten.permute.default(grad_input, [0, rank + 1] + list(range(1, rank + 1)))
    return aten.squeeze.dims(grad_input, [0]) if unbatched else grad_input


def _tiled(kernel, stride, padding, dilation, sizes, outputs) -> bool:
    """Whether the windows tile the input's start without overlap or padding (kernel == stride, no
    padding or dilation, no window that ceil_mode adds): ``MaxPool2d(2)``, ``AvgPool2d(2)``."""
    return (kernel == stride and not any(padding) and all(d == 1 for d in dilation)
            and all(o * k <= size for o, k, size in zip(outputs, kernel, sizes, strict=True)))


def _crop(x: torch.Tensor, kernel: Sequence[int], outputs: Sequence[int]) -> torch.Tensor:
    """``x`` without the positions past the last tiled window (those a floored output never reads)."""
    for axis, (o, k) in enumerate(zip(outputs, kernel, strict=True)):
        if x.shape[2 + axis] != o * k:
            x = aten.slice.Tensor(x, 2 + axis, 0, o * k)
    return x


def _upsample(t: torch.Tensor, kernel: Sequence[int]) -> torch.Tensor:
    """``[N, C, O...]`` -> ``[N, C, O*k...]``: each element copied over its (tiled) window.

    The last two spatial dims in one MatMul with a constant 0/1 matrix ``[O_w, k_h * O_w*k_w]``
    (a row of ``t`` becomes its window rows; exact for finite values, an infinity makes its row
    NaN), an earlier one (3-D) by a Concat of ``k`` copies: onnxruntime broadcasts, Expands and
    Transposes over an innermost axis of ``k`` elements element by element, which is slow.
    """
    channels, outputs, rank = t.shape[1], list(t.shape[2:]), len(kernel)
    rows = kernel[-2] if rank > 1 else 1
    matrix = np.tile(np.repeat(np.eye(outputs[-1]), kernel[-1], axis=1), (1, rows))
    spread = aten.mm.default(aten.reshape.default(t, [-1, outputs[-1]]), constant(matrix, t))
    sizes = outputs[:-2] + [o * k for o, k in zip(outputs[-2:], kernel[-2:], strict=True)]
    for axis in reversed(range(rank - 2)):
        later = math.prod(sizes[axis + 1:])
        spread = aten.unsqueeze.default(aten.reshape.default(spread, [-1, outputs[axis], later]), 2)
        spread = aten.cat.default([spread] * kernel[axis], 2)
        sizes[axis] = outputs[axis] * kernel[axis]
    return aten.reshape.default(spread, [-1, channels] + sizes)


def _max_pool_backward_tiled(grad_output: torch.Tensor, x: torch.Tensor, kernel: Sequence[int]) -> torch.Tensor:
    """Tiled max pooling's input gradient at full resolution, the first maximum of each window
    taking it (module docstring); ``x`` holds exactly the tiled windows."""
    pool = _MAX_POOL[len(kernel)]
    count = math.prod(kernel)
    scale = float(2 ** count.bit_length())  # a power of two > count: every step below is exact
    pooled = pool(x, list(kernel), list(kernel))[0]
    miss = aten.ceil.default(aten.sub.Tensor(_upsample(pooled, kernel), x))
    key = aten.sub.Tensor(constant(_priority(kernel, list(x.shape[2:])) / scale, x), miss)
    best = aten.sub.Tensor(pool(key, list(kernel), list(kernel))[0], 1.0 / scale)
    first = aten.relu.default(aten.sub.Tensor(key, _upsample(best, kernel)))
    return aten.mul.Tensor(first, _upsample(aten.mul.Tensor(grad_output, scale), kernel))


def _priority(kernel: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """``[1, 1, sizes...]``: ``K - j`` at the positions of row-major kernel offset ``j`` of each window."""
    offset = np.zeros([1] * len(sizes))
    for axis, k in enumerate(kernel):
        shape = [1] * len(sizes)
        shape[axis] = sizes[axis]
        offset = offset * k + (np.arange(sizes[axis]) % k).reshape(shape)
    return (math.prod(kernel) - offset)[None, None]


def _route_to_first_max(windows: list[torch.Tensor], grad_output: torch.Tensor) -> list[torch.Tensor]:
    """Per kernel offset, the gradient that offset receives: all of a window's gradient goes to
    its FIRST maximum (torch's choice among ties), none to the others.

    The max is an elementwise Max of the offsets (exact, so ``==`` finds it); a boolean "maximum
    seen" is carried from offset to offset (Or), and an offset is the first maximum where it
    turns true (Xor with the previous one), and the gradient times that offset's 0/1 mask, a Where
    between two scalars (onnxruntime's Where of a tensor and a scalar is slower than that Where and
    the Mul). Like ReLU's backward, it differs from torch only on a non-finite gradient (NaN, not 0,
    at the window's other offsets). Only Max, Equal, Or, Xor, Where and Mul: no ArgMax over a
    stacked window axis, which IREE compiles to a stack buffer past its 32 KiB limit at real sizes.
    """
    pooled = functools.reduce(aten.maximum.default, windows)
    zero = constant(np.zeros(()), grad_output)
    one = constant(np.ones(()), grad_output)
    seen, routed = None, []
    for window in windows:
        is_max = aten.eq.Tensor(window, pooled)
        first = is_max
        if seen is not None:
            now = aten.logical_or.default(seen, is_max)
            first, seen = aten.logical_xor.default(now, seen), now
        else:
            seen = is_max
        routed.append(aten.mul.Tensor(grad_output, aten.where.self(first, one, zero)))
    return routed


def _ones_weight(channels: int, kernel: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return constant(np.ones([channels, 1] + list(kernel)), like)


@_per_rank({2: aten.avg_pool2d.default, 3: aten.avg_pool3d.default})
def lower_avg_pool(rank, x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    """Windows that ceil_mode adds, or a divisor_override: a sum Conv divided by torch's divisor.

    Every other average pool is left to the ``AveragePool`` emitter.
    """
    kernel, stride, padding, _ = _pool_args(rank, kernel_size, stride, padding)
    sizes = list(x.shape[-rank:])
    outputs = [pooled_size(i, k, s, p, 1, ceil_mode) for i, k, s, p in zip(sizes, kernel, stride, padding, strict=True)]
    floors = [pooled_size(i, k, s, p, 1, False) for i, k, s, p in zip(sizes, kernel, stride, padding, strict=True)]
    if outputs == floors and not divisor_override:
        return NotImplemented
    unbatched = x.dim() == rank + 1
    x = _channels_first(x, rank)
    pad = []
    for size, o, k, s, p in reversed(list(zip(sizes, outputs, kernel, stride, padding, strict=True))):
        pad += [p, (o - 1) * s + k - size - p]
    padded = aten.constant_pad_nd.default(x, pad, 0.0)
    channels = x.shape[1]
    sums = aten.convolution.default(
        padded, _ones_weight(channels, kernel, x), None, stride, [0] * rank, [1] * rank, False, [0] * rank, channels
    )
    divisor = avg_pool_divisor(sizes, outputs, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    y = aten.div.Tensor(sums, constant(divisor, x))
    return aten.squeeze.dims(y, [0]) if unbatched else y


@_per_rank({2: aten.avg_pool2d_backward.default, 3: aten.avg_pool3d_backward.default})
def avg_pool_backward(rank, grad_output, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _ = _pool_args(rank, kernel_size, stride, padding)
    unbatched = x.dim() == rank + 1
    x, grad_output = _channels_first(x, rank), _channels_first(grad_output, rank)
    sizes, outputs = list(x.shape[2:]), list(grad_output.shape[2:])
    divisor = avg_pool_divisor(sizes, outputs, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    scaled = aten.div.Tensor(grad_output, constant(divisor, grad_output))
    channels = x.shape[1]
    if _tiled(kernel, stride, padding, [1] * rank, sizes, outputs):
        grad_input = fit_spatial(_upsample(scaled, kernel), sizes)
    else:
        grad_input = input_grad(scaled, _ones_weight(channels, kernel, x), sizes, stride, padding, [1] * rank, channels)
    return aten.squeeze.dims(grad_input, [0]) if unbatched else grad_input


def adaptive_matrix(size: int, out: int) -> np.ndarray:
    """``[out, size]``: row ``i`` averages torch's adaptive window ``floor(i*L/O) .. ceil((i+1)*L/O)``."""
    matrix = np.zeros((out, size))
    for i in range(out):
        start, end = (i * size) // out, -(-((i + 1) * size) // out)
        matrix[i, start:end] = 1.0 / (end - start)
    return matrix


def _apply_per_dim(x: torch.Tensor, matrices: Sequence[np.ndarray]) -> torch.Tensor:
    """Contract the last ``len(matrices)`` dims of ``x`` with ``x[..., l] -> sum_l m[o, l] x[..., l]``."""
    rank = len(matrices)
    for axis, matrix in enumerate(matrices):
        dim = x.dim() - rank + axis
        order = [d for d in range(x.dim()) if d != dim] + [dim]
        moved = aten.permute.default(x, order)
        product = aten.matmul.default(moved, constant(matrix.T, x))
        inverse = [order.index(d) for d in range(x.dim())]
        x = aten.permute.default(product, inverse)
    return x


@lowers(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool(x, output_size):
    rank = len(output_size)
    return _apply_per_dim(x, [adaptive_matrix(l, o) for l, o in zip(x.shape[-rank:], output_size, strict=True)])


@_per_rank({2: aten._adaptive_avg_pool2d_backward.default, 3: aten._adaptive_avg_pool3d_backward.default})
def adaptive_avg_pool_backward(rank, grad_output, x):
    matrices = [adaptive_matrix(l, o).T for l, o in zip(x.shape[-rank:], grad_output.shape[-rank:], strict=True)]
    return _apply_per_dim(grad_output, matrices)
