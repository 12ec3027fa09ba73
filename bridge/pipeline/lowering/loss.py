"""Loss lowerings: negative log-likelihood (the core of cross-entropy) with one-hot masks.

torch's own decomposition picks the target's log-probability with gather and builds the
gradient with scatter; onnx-mlir has no NegativeLogLikelihoodLoss and restricts
ScatterElements, so both directions are written with ``target == arange(C)`` masks:
dense Equal/Where/ReduceSum ops only.
"""
from __future__ import annotations

import torch

from . import lowers

aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # torch's reduction enum: 0 none, 1 mean, 2 sum


def _one_hot(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Boolean mask [N, C, ...] (or [C]) that is true at each sample's target class."""
    channel = 0 if log_probs.dim() == 1 else 1
    shape = [1] * log_probs.dim()
    shape[channel] = log_probs.shape[channel]
    classes = torch.arange(log_probs.shape[channel], device=target.device).reshape(shape)
    return target.unsqueeze(channel) == classes


def _sample_weights(log_probs, target, weight, ignore_index, one_hot) -> torch.Tensor:
    """Per-sample weight: the class weight of the target (1 without weights), 0 if ignored."""
    channel = 0 if log_probs.dim() == 1 else 1
    if weight is None:
        per_sample = torch.ones_like(target, dtype=log_probs.dtype)
    else:
        shape = [1] * log_probs.dim()
        shape[channel] = -1
        per_sample = torch.where(one_hot, weight.reshape(shape), 0.0).sum(channel)
    return torch.where(target == ignore_index, 0.0, per_sample)  # no Not of an inequality


@lowers(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(log_probs, target, weight, reduction, ignore_index):
    channel = 0 if log_probs.dim() == 1 else 1
    one_hot = _one_hot(log_probs, target)
    weights = _sample_weights(log_probs, target, weight, ignore_index, one_hot)
    picked = torch.where(one_hot, log_probs, 0.0).sum(channel)
    losses = -picked * weights
    total_weight = weights.sum()
    if reduction == _SUM:
        return losses.sum(), total_weight
    if reduction == _MEAN:
        return losses.sum() / total_weight, total_weight
    return losses, total_weight


@lowers(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, log_probs, target, weight, reduction, ignore_index, total_weight):
    channel = 0 if log_probs.dim() == 1 else 1
    one_hot = _one_hot(log_probs, target)
    weights = _sample_weights(log_probs, target, weight, ignore_index, one_hot)
    scale = grad_output / total_weight if reduction == _MEAN else grad_output
    per_sample = -(weights * scale)
    return torch.where(one_hot, per_sample.unsqueeze(channel), 0.0)


@lowers(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, input, target, reduction, delta):
    """torch's formula, with the mean's 1/numel applied to the tensor first: negating a
    symbolic-batch float (``-1/numel``) has no ONNX emitter, ``x * -delta`` does."""
    scaled = grad_output * (1.0 / input.numel()) if reduction == _MEAN else grad_output
    x = input - target
    return torch.where(x < -delta, scaled * -delta, torch.where(x > delta, scaled * delta, scaled * x))


@lowers(aten.xlogy.Tensor)
def xlogy(x, y):
    """``x * log(y)``, 0 where x == 0, NaN where y is NaN (kl_div's ``target * log(target)``).

    torch's decomposition tests NaN with IsNaN, which onnx-mlir accepts only from opset 20;
    ``y != y`` is the same test in Equal/Not.
    """
    zeroed = torch.where(x == 0, 0.0, x * torch.log(y))
    return torch.where(y != y, y, zeroed)
