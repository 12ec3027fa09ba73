"""Activation ONNX ops. Each is written with the torch function of the same meaning."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..registry import converter


@converter("Relu")
def relu(ctx, x):
    return F.relu(x)


@converter("LeakyRelu")
def leaky_relu(ctx, x):
    return F.leaky_relu(x, ctx.attr("alpha", 0.01))


@converter("PRelu")
def prelu(ctx, x, slope):
    return torch.where(x >= 0, x, x * slope)


@converter("Elu")
def elu(ctx, x):
    return F.elu(x, ctx.attr("alpha", 1.0))


@converter("Celu")
def celu(ctx, x):
    return F.celu(x, ctx.attr("alpha", 1.0))


@converter("Selu")
def selu(ctx, x):
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


@converter("ThresholdedRelu")
def thresholded_relu(ctx, x):
    return torch.where(x > ctx.attr("alpha", 1.0), x, torch.zeros_like(x))


@converter("Sigmoid")
def sigmoid(ctx, x):
    return torch.sigmoid(x)


@converter("HardSigmoid")
def hard_sigmoid(ctx, x):
    return torch.clamp(ctx.attr("alpha", 0.2) * x + ctx.attr("beta", 0.5), 0.0, 1.0)


@converter("HardSwish")
def hard_swish(ctx, x):
    return x * torch.clamp(x / 6.0 + 0.5, 0.0, 1.0)


@converter("Tanh")
def tanh(ctx, x):
    return torch.tanh(x)


@converter("Softplus")
def softplus(ctx, x):
    return F.softplus(x)


@converter("Softsign")
def softsign(ctx, x):
    return x / (1 + torch.abs(x))


@converter("Mish")
def mish(ctx, x):
    return x * torch.tanh(F.softplus(x))


@converter("Gelu")
def gelu(ctx, x):
    # The tanh form is written out: IREE's Gelu(tanh) lowering has a wrong constant.
    if ctx.attr("approximate", "none") == "tanh":
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1 + torch.tanh(inner))
    return 0.5 * x * (1 + torch.erf(x * 0.7071067811865476))


def _softmax_axis(ctx, x) -> int:
    default = -1 if ctx.opset >= 13 else 1
    return ctx.attr("axis", default)


def _coerced(ctx, x, fn):
    """Softmax family before opset 13 works on the input flattened to 2-D at ``axis``."""
    axis = _softmax_axis(ctx, x)
    if ctx.opset >= 13:
        return fn(x, axis)
    axis = axis % x.dim()
    flat = x.reshape(math.prod(x.shape[:axis]), -1)
    return fn(flat, 1).reshape(x.shape)


@converter("Softmax")
def softmax(ctx, x):
    return _coerced(ctx, x, lambda t, axis: torch.softmax(t, axis))


@converter("LogSoftmax")
def log_softmax(ctx, x):
    return _coerced(ctx, x, lambda t, axis: torch.log_softmax(t, axis))


@converter("Hardmax")
def hardmax(ctx, x):
    axis = _softmax_axis(ctx, x)
    index = torch.argmax(x, dim=axis, keepdim=True)
    return torch.zeros_like(x).scatter(axis, index, 1.0)
