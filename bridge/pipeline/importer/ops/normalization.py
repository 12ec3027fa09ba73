"""Normalization ops: BatchNormalization, LayerNormalization, InstanceNormalization,
GroupNormalization, LpNormalization, MeanVarianceNormalization.

Every statistic is written with explicit reductions (mean of x, mean of the squared
deviation), never with native_batch_norm / native_layer_norm, so the traced forward and
autograd's backward are both plain Reduce/Sub/Mul/Sqrt ops that onnx-mlir accepts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ....errors import ShapeError
from ... import targets
from ...primitives import affine
from ...replay import replayed
from ..registry import converter


def _normalize(x: torch.Tensor, dims: list[int], epsilon: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x - mean) / sqrt(var + eps)`` over ``dims`` (biased variance); also mean and variance."""
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    var = (centered * centered).mean(dims, keepdim=True)
    return centered * torch.rsqrt(var + epsilon), mean, var


def _channel(param: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-channel [C] parameter shaped to broadcast over [N, C, ...]."""
    return param.reshape([1, -1] + [1] * (rank - 2))


@converter("BatchNormalization", buffers=(3, 4))
def batch_normalization(ctx, x, scale, bias, running_mean, running_var):
    """Batch statistics when bridge trains or the node asks for them (``training_mode=1`` from
    opset 14, extra outputs before); running statistics otherwise, and when bridge trains with
    ``batch_norm="frozen"`` (``ctx.frozen_batch_norm``: torch's BatchNorm in ``eval()``).

    With batch statistics the running ones move by ONNX ``momentum`` (torch's 1 - momentum):
    ``running = momentum * running + (1 - momentum) * batch``. The buffers bridge updates take
    the unbiased batch variance, as torch's BatchNorm does; the node's own running-variance
    output takes the biased one, as the ONNX spec (and onnxruntime) define it. Normalization
    uses the biased one.
    """
    epsilon, momentum = ctx.attr("epsilon", 1e-5), ctx.attr("momentum", 0.9)
    if ctx.opset < 9 and ctx.attr("spatial", 1) == 0:
        raise ctx.unsupported("spatial=0 (per-element statistics)")
    rank = x.dim()
    node_training = ctx.attr("training_mode", 0) if ctx.opset >= 14 else len(ctx.node.output) > 1
    if ctx.frozen_batch_norm or not (ctx.training or node_training and not ctx.evaluation):
        y = _BatchNormRunning.apply(x, scale, bias, running_mean, running_var, epsilon)
        # evaluating a training node: its statistics outputs (and before opset 14 its saved ones, which the
        # spec leaves to training) are the running ones, unchanged
        return (y, running_mean, running_var, running_mean, running_var)[:len(ctx.node.output)] if node_training else y
    count = x.numel() // x.shape[1]
    if count <= 1:
        raise ShapeError(
            f"BatchNormalization node '{ctx.name}': training needs more than 1 value per channel, "
            f"got input shape {list(x.shape)} (as torch's batch_norm)"
        )
    y, batch_mean, batch_var = _BatchNormTraining.apply(x, scale, bias, epsilon)
    statistics = (running_mean, running_var, batch_mean, batch_var, momentum, count, ctx.training)
    new_mean, new_var, spec_var = replayed(_running_statistics, *statistics, pointwise=True)
    if ctx.training:
        ctx.update_buffer(3, new_mean)
        ctx.update_buffer(4, new_var)
    extra = [new_mean, spec_var]
    if ctx.opset < 14 and len(ctx.node.output) > 3:  # the saved statistics, differentiable as the graph may use them
        _, mean, var = _normalize(x.to(_wide(x.dtype)), [0] + list(range(2, rank)), epsilon)
        extra += [mean.to(x.dtype).reshape(-1), var.to(x.dtype).reshape(-1)]
    return (y, *extra[:len(ctx.node.output) - 1])


def _running_statistics(running_mean: torch.Tensor, running_var: torch.Tensor, batch_mean: torch.Tensor,
                        batch_var: torch.Tensor, momentum: float, count: int, training: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """BatchNorm's new running mean, the new running variance bridge trains with (from the unbiased batch
    variance; None unless ``training``) and the node's own running-variance output (from the biased one).
    Elementwise over [C]: traced once per ``momentum``, ``count`` and ``training``, whatever ``C``, and replayed
    (``bridge.pipeline.replay.replayed(..., pointwise=True)``); a symbolic ``count`` is traced every time."""
    new_mean = momentum * running_mean + (1 - momentum) * batch_mean
    if not training:
        new_var = None
    elif isinstance(count, int):  # one constant factor (a symbolic count stays tensor arithmetic, exact)
        new_var = momentum * running_var + batch_var * ((1 - momentum) * count / (count - 1))
    else:
        new_var = momentum * running_var + (1 - momentum) * batch_var * count / (count - 1)
    return new_mean, new_var, momentum * running_var + (1 - momentum) * batch_var


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype BatchNorm's batch statistics accumulate in: float64 for float32, as torch's CPU
    kernel accumulates them (at::acc_type<float> is double). A BatchNorm followed by global pooling
    cancels heavily in its backward, and with float32 sums the gradients upstream drift by percents."""
    return torch.float64 if dtype == torch.float32 else dtype


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's CPU BatchNorm computes a float16/bfloat16 input in (mixed precision): float32, each
    result rounded once to the input's type."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _channel_mean(t: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """Per-channel mean of ``t`` ([N, C, ...]) over every dim but 1, shaped [1, C, 1, ...], in
    ``wide``: means along the last (contiguous) dim in ``t``'s dtype, the rest in ``wide``. Only
    those partial means (1/W of ``t``) are cast: W values summed in float32 lose about as little
    as float64, where one float32 sum over N*H*W drifts."""
    if t.dim() <= 2:
        return t.to(wide).mean(0, keepdim=True)
    return t.mean(-1, keepdim=True).to(wide).mean([0] + list(range(2, t.dim() - 1)), keepdim=True)


class _BatchNormTraining(torch.autograd.Function):
    """BatchNorm with the batch's statistics, forward and backward as torch's CPU kernel computes
    them (aten/src/ATen/native/cpu/batch_norm_kernel.cpp): per-channel means that end in float64
    (``_wide``, ``_channel_mean``), every full-size op in ``x``'s dtype.

    Forward: ``c = x - m`` (``m`` the float64 mean rounded to ``x``'s dtype), ``var = mean(c^2)``,
    ``y = c * a + bias`` with ``a = invstd * scale``. Backward: ``d = mean(dy * c) - shift * mean(dy)``
    (``shift = mean - m``, the part of the mean ``m`` drops, which matters for inputs far from 0),
    ``dx = (dy - (c * d * invstd^2 + mean(dy))) * a``, ``dscale = d * count * invstd``,
    ``dbias = mean(dy) * count``; ``c * a + bias`` and ``c * (d * invstd^2) + mean(dy)`` are one
    ``affine`` each (bridge/pipeline/primitives.py). The per-channel values after the reductions take the
    layout the target's ``affine`` reads as it is (``_per_channel``).

    Returns ``y`` and the batch mean and biased variance ([C], ``x``'s dtype, not differentiable).
    Traced once per shape (``bridge.pipeline.replay.replayed``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, epsilon: float):
        y, mean_out, var_out, *saved = replayed(_batch_norm_forward, x.to(_opmath(x.dtype)), scale, bias, epsilon)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(mean_out, var_out)
        ctx.set_materialize_grads(False)  # no zeros traced for the statistics' gradients, which backward ignores
        return y.to(x.dtype), mean_out.to(x.dtype), var_out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, _mean_grad, _var_grad):
        dx, grad_scale, grad_bias = replayed(_batch_norm_backward, dy.to(_opmath(dy.dtype)), *ctx.saved_tensors,
                                             *ctx.needs_input_grad[1:3])
        return dx.to(dy.dtype), grad_scale, grad_bias, None


class _BatchNormRunning(torch.autograd.Function):
    """BatchNorm with fixed running statistics, forward and backward as torch's CPU kernel computes them
    in ``eval()``: ``y = x * a + (bias - mean * a)`` with ``a = scale / sqrt(var + eps)`` (one ``affine``);
    ``dx = dy * a``, ``dscale = sum(dy * (x - mean)) / sqrt(var + eps)``, ``dbias = sum(dy)``, the sums ending
    in float64 as the training form's (``_channel_mean``). The statistics get no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor,
                var: torch.Tensor, epsilon: float):
        dtype = _opmath(x.dtype)
        invstd = torch.rsqrt(var.to(dtype) + epsilon)
        alpha = invstd * scale.to(dtype)
        ctx.save_for_backward(x, mean, invstd, alpha)
        return affine(x.to(dtype), alpha, bias.to(dtype) - mean.to(dtype) * alpha).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, mean, invstd, alpha = ctx.saved_tensors
        rank, count, dtype = x.dim(), x.numel() // x.shape[1], _opmath(dy.dtype)
        dy = dy.to(dtype)
        needs_x, needs_scale, needs_bias = ctx.needs_input_grad[:3]
        dx = (dy * _channel(alpha, rank)).to(x.dtype) if needs_x else None
        grad_scale = grad_bias = None
        if needs_scale:
            centered = x.to(dtype) - _channel(mean.to(dtype), rank)
            grad_scale = _flat(_channel_mean(dy * centered, _wide(dtype)).to(dtype)) * (invstd * count)
        if needs_bias:
            grad_bias = _flat(_channel_mean(dy, _wide(dtype)).to(dtype)) * count
        return dx, grad_scale, grad_bias, None, None, None


def _per_channel(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-channel value ``[1, C, 1...]`` (or ``[C]``) in the layout ``affine`` emits without Reshapes: ``[C]``
    where it is a BatchNormalization (the target form ``affine_as_batch_norm``), else ``[1, C, 1...]`` (a Mul
    and an Add). The other uses (``[C]`` results, products with ``[N, C, ...]``) then pay one Reshape each."""
    return _flat(t) if targets.enabled("affine_as_batch_norm") else _channel(t, rank)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[C]``, with no view of a view (two Reshapes of one value would not merge)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _batch_norm_forward(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, epsilon: float):
    """``_BatchNormTraining``'s forward: ``y``, the batch mean and variance, and what its backward reads."""
    rank, wide = x.dim(), _wide(x.dtype)
    mean = _channel_mean(x, wide)
    mean_x = mean.to(x.dtype)
    centered = x - mean_x
    var = _per_channel(_channel_mean(centered * centered, wide), rank)
    invstd = torch.rsqrt(var + epsilon).to(x.dtype)
    alpha = invstd * _per_channel(scale, rank)
    y = affine(centered, _flat(alpha), bias)
    shift = mean - mean_x.to(wide)
    return y, _flat(mean_x), _flat(var.to(x.dtype)), centered, shift, invstd, _channel(alpha, rank)


def _batch_norm_backward(dy: torch.Tensor, centered: torch.Tensor, shift: torch.Tensor, invstd: torch.Tensor,
                         alpha: torch.Tensor, needs_scale: bool, needs_bias: bool):
    """``_BatchNormTraining``'s backward: the gradients of x, scale (or None) and bias (or None)."""
    rank, count = centered.dim(), centered.numel() // centered.shape[1]
    mean_dy = _channel_mean(dy, shift.dtype)
    dot = _per_channel((_channel_mean(dy * centered, shift.dtype) - shift * mean_dy).to(dy.dtype), rank)
    mean_dy = _per_channel(mean_dy.to(dy.dtype), rank)
    dx = (dy - affine(centered, _flat(dot * invstd * invstd), _flat(mean_dy))) * alpha
    grad_scale = _flat(dot * (invstd * count)) if needs_scale else None
    grad_bias = _flat(mean_dy * count) if needs_bias else None
    return dx, grad_scale, grad_bias


@converter("LayerNormalization")
def layer_normalization(ctx, x, scale, bias=None):
    """A float16/bfloat16 ``x`` (mixed precision) is normalized in float32 and the result rounded once, as torch's
    CPU layer_norm computes it."""
    axis, dtype = ctx.attr("axis", -1) % x.dim(), x.dtype
    normalized, mean, var = _normalize(x.to(_opmath(dtype)), list(range(axis, x.dim())), ctx.attr("epsilon", 1e-5))
    y = normalized * scale
    if bias is not None:
        y = y + bias
    return (y.to(dtype), mean, torch.rsqrt(var + ctx.attr("epsilon", 1e-5)))[:len(ctx.node.output)]


@converter("InstanceNormalization")
def instance_normalization(ctx, x, scale, bias):
    normalized, _, _ = _normalize(x, list(range(2, x.dim())), ctx.attr("epsilon", 1e-5))
    return normalized * _channel(scale, x.dim()) + _channel(bias, x.dim())


@converter("GroupNormalization")
def group_normalization(ctx, x, scale, bias):
    """Opset 21 semantics: scale and bias per channel. (GroupNormalization-18, with them per group,
    is deprecated and fails onnx.checker, so such models stop at load.)"""
    groups, channels = ctx.attr("num_groups"), x.shape[1]
    if channels % groups:
        raise ShapeError(f"GroupNormalization node '{ctx.name}': {channels} channels are not divisible by num_groups={groups}")
    normalized, _, _ = _normalize(x.reshape(x.shape[0], groups, -1), [2], ctx.attr("epsilon", 1e-5))
    return normalized.reshape(x.shape) * _channel(scale, x.dim()) + _channel(bias, x.dim())


# F.normalize's floor of the norm: at an all-zero slice its gradient is the upstream one / eps
NORMALIZE_EPS = 1e-12


@converter("LpNormalization")
def lp_normalization(ctx, x):
    """``x / ||x||_p`` along ``axis``. An all-zero slice gives 0 (as onnxruntime and the ONNX
    reference do) with torch's gradient there: ``F.normalize`` divides by ``max(norm, 1e-12)``, so
    the slice's gradient is the upstream gradient / 1e-12. Elsewhere the division is exact."""
    axis, p = ctx.attr("axis", -1), ctx.attr("p", 2)
    if p not in (1, 2):
        raise ctx.unsupported(f"p={p} (only 1 and 2 exist in ONNX)")
    total = x.abs().sum(axis, keepdim=True) if p == 1 else (x * x).sum(axis, keepdim=True)
    zero = total == 0
    safe = torch.where(zero, torch.ones_like(total), total)
    norm = safe if p == 1 else torch.sqrt(safe)
    return torch.where(zero, x / NORMALIZE_EPS, x / norm)


@converter("MeanVarianceNormalization")
def mean_variance_normalization(ctx, x):
    """``(x - mean) / (sqrt(var) + 1e-9)`` over ``axes`` (default [0, 2, 3]), as ONNX defines it."""
    dims = [a % x.dim() for a in ctx.attr("axes", [0, 2, 3])]
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    return centered / (torch.sqrt((centered * centered).mean(dims, keepdim=True)) + 1e-9)


@converter("LRN")
def lrn(ctx, x):
    """Local response normalization across channels: ``x / (bias + alpha / size * sum(x^2))^beta``,
    the sum over ``floor((size-1)/2)`` channels before and ``ceil((size-1)/2)`` after, as shifted
    slices of the zero-padded squares."""
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    channels = x.shape[1]
    padded = F.pad(x * x, [0, 0] * (x.dim() - 2) + [(size - 1) // 2, size // 2])
    window = sum(padded.narrow(1, k, channels) for k in range(size))
    return x / (bias + alpha / size * window) ** beta
