"""Convolution backward (and transposed convolution) written with stride-1 and strided ``Conv``.

onnx-mlir compiles ``ConvTranspose`` only with a constant weight, so no gradient and no
trainable transposed layer may use it. Everything here is ``aten.convolution`` (non
transposed), ``constant_pad_nd`` (negative pads crop), reshape/permute and ``flip``:

* ``input_grad`` (the transposed convolution): zero-insert ``grad_output`` by the stride
  (unsqueeze, pad, reshape), pad it so that a stride-1 Conv with the spatially flipped,
  in/out-swapped weight (per group) and the forward dilation lands exactly on the input
  positions, padding with zeros where the forward output floored.
* ``weight_grad``: a Conv whose batch and channel roles are swapped: the input, as
  ``[Cin/g, g*N, L]``, is convolved with ``grad_output`` as a weight ``[g*Cout/g, N, O]``
  (groups ``g``, stride = forward dilation, dilation = forward stride), then sliced to the
  kernel size.
* ``grad_bias``: a sum over batch and spatial dims.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..geometry import per_dim, torch_pad
from . import lowers

aten = torch.ops.aten


def _spatial(x: torch.Tensor) -> list[int]:
    return list(x.shape[2:])


def fit_spatial(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Crop (or zero-pad) the end of each spatial dim of ``x`` to ``sizes``."""
    have = _spatial(x)
    if have == list(sizes):
        return x
    return aten.constant_pad_nd.default(x, torch_pad([0] * len(have), [s - h for s, h in zip(sizes, have)]), 0.0)


def zero_insert(x: torch.Tensor, stride: Sequence[int]) -> torch.Tensor:
    """Insert ``stride - 1`` zeros after each spatial element: ``[N, C, O]`` -> ``[N, C, O * s]``."""
    if all(s == 1 for s in stride):
        return x
    n, c, sizes = x.shape[0], x.shape[1], _spatial(x)
    interleaved = [n, c]
    for size in sizes:
        interleaved += [size, 1]
    y = aten.reshape.default(x, interleaved)
    pad = []
    for s in reversed(stride):
        pad += [0, s - 1, 0, 0]
    y = aten.constant_pad_nd.default(y, pad[:-2], 0.0)
    return aten.reshape.default(y, [n, c] + [size * s for size, s in zip(sizes, stride)])


def _swapped_flipped_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``[g*Co, Ci, k...]`` -> ``[g*Ci, Co, k...]`` flipped spatially (the transposed kernel)."""
    out_channels, in_per_group, kernel = weight.shape[0], weight.shape[1], list(weight.shape[2:])
    per_group = out_channels // groups
    w = aten.reshape.default(weight, [groups, per_group, in_per_group] + kernel)
    w = aten.permute.default(w, [0, 2, 1] + list(range(3, 3 + len(kernel))))
    w = aten.reshape.default(w, [groups * in_per_group, per_group] + kernel)
    return aten.flip.default(w, list(range(2, 2 + len(kernel))))


def input_grad(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """d(conv(x, weight))/dx applied to ``grad_output``; ``input_size`` is x's spatial size.

    The gradient of input position ``j`` sits at position ``j + p`` of the "full" transposed
    result, whose first element needs a ``d*(k-1)`` zero border before the zero-inserted
    ``grad_output``; hence begin pad ``d*(k-1) - p`` and an end pad that yields exactly
    ``input_size`` positions (zeros past the last window when the forward output floored,
    cropping windows that reach past the padded input, as ceil_mode pooling does).
    """
    kernel = list(weight.shape[2:])
    outputs = _spatial(grad_output)
    spread = zero_insert(grad_output, stride)
    begins, ends = [], []
    for o, k, s, p, d, size in zip(outputs, kernel, stride, padding, dilation, input_size):
        begin = d * (k - 1) - p
        begins.append(begin)
        ends.append(size + d * (k - 1) - begin - o * s)  # o * s: the spread length (trailing zeros included)
    conv_padding = [0] * len(kernel)
    if all(b == e and b >= 0 for b, e in zip(begins, ends)):
        conv_padding, begins, ends = begins, [0] * len(kernel), [0] * len(kernel)
    if any(begins) or any(ends):
        spread = aten.constant_pad_nd.default(spread, torch_pad(begins, ends), 0.0)
    w = _swapped_flipped_weight(weight, groups)
    ones = [1] * len(kernel)
    return aten.convolution.default(spread, w, None, ones, conv_padding, list(dilation), False, [0] * len(kernel), groups)


def weight_grad(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """d(conv(x, w))/dw applied to ``grad_output``: a Conv over the batch, per group."""
    n, in_channels, sizes = x.shape[0], x.shape[1], _spatial(x)
    out_channels, outputs = grad_output.shape[1], _spatial(grad_output)
    in_per_group, out_per_group = in_channels // groups, out_channels // groups
    rank = len(sizes)
    spatial = list(range(3, 3 + rank))
    xs = aten.reshape.default(x, [n, groups, in_per_group] + sizes)
    xs = aten.permute.default(xs, [2, 1, 0] + spatial)
    xs = aten.reshape.default(xs, [in_per_group, groups * n] + sizes)
    gs = aten.reshape.default(grad_output, [n, groups, out_per_group] + outputs)
    gs = aten.permute.default(gs, [1, 2, 0] + spatial)
    gs = aten.reshape.default(gs, [groups * out_per_group, n] + outputs)
    full = aten.convolution.default(xs, gs, None, list(dilation), list(padding), list(stride), False, [0] * rank, groups)
    return aten.permute.default(fit_spatial(full, weight_size[2:]), [1, 0] + list(range(2, 2 + rank)))


def transposed_output_size(
    x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, output_padding
) -> list[int]:
    return [
        (i - 1) * s - 2 * p + d * (k - 1) + op + 1
        for i, k, s, p, d, op in zip(_spatial(x), weight.shape[2:], stride, padding, dilation, output_padding)
    ]


def _bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    return aten.sum.dim_IntList(grad_output, [0] + list(range(2, grad_output.dim())))


@lowers(aten.convolution.default)
def lower_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Transposed convolution as the input gradient of a Conv (so it never becomes ConvTranspose)."""
    if not transposed:
        return NotImplemented
    rank = weight.dim() - 2
    stride, padding, dilation = per_dim(stride, rank), per_dim(padding, rank), per_dim(dilation, rank)
    output_padding = per_dim(output_padding, rank, 0)
    size = transposed_output_size(x, weight, stride, padding, dilation, output_padding)
    y = input_grad(x, weight, size, stride, padding, dilation, groups)
    if bias is not None:
        y = aten.add.Tensor(y, aten.reshape.default(bias, [1, -1] + [1] * len(size)))
    return y


@lowers(aten.convolution_backward.default)
def convolution_backward(
    grad_output, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """(grad_input, grad_weight, grad_bias), each ``None`` where ``output_mask`` is false.

    A transposed convolution ``y = convT(x, w)`` is the input gradient of ``conv(., w)``, so
    its gradients are that Conv's forward (for x) and its weight gradient with the roles of
    input and grad_output exchanged (for w).
    """
    rank = weight.dim() - 2
    stride, padding, dilation = per_dim(stride, rank), per_dim(padding, rank), per_dim(dilation, rank)
    grad_input = grad_weight = grad_bias = None
    if transposed:
        if output_mask[0]:  # an output_padding >= stride makes this Conv one window longer than x
            conv = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, False, [0] * rank, groups)
            grad_input = fit_spatial(conv, _spatial(x))
        if output_mask[1]:
            grad_weight = weight_grad(x, grad_output, weight.shape, stride, padding, dilation, groups)
    else:
        if output_mask[0]:
            grad_input = input_grad(grad_output, weight, _spatial(x), stride, padding, dilation, groups)
        if output_mask[1]:
            grad_weight = weight_grad(grad_output, x, weight.shape, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = _bias_grad(grad_output)
    return grad_input, grad_weight, grad_bias
