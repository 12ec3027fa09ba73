"""Activation ONNX ops, written as explicit differentiable formulas (``where``/``exp``/``clamp``
...) whose forward and backward both have ONNX emitters: ``F.leaky_relu``/``F.elu`` are
core-ATen ops that have neither a decomposition nor an emitter.

An ``exp`` in the branch ``where`` does not take is evaluated anyway, and its backward
multiplies the zero gradient of that branch by ``exp(x)``: ``0 * inf = NaN`` for a large
``x``. The exponential branches therefore see ``x`` with its positive part replaced by 0
(``_expm1_negative``).

At the kinks the gradient is torch's: ELU/SELU/CELU and PRelu take the negative branch's
derivative at ``x = 0`` (``alpha``, ``scale * alpha``, 1, the slope), as ``F.elu``/``F.prelu``."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import converter

# ONNX float attributes are float32, defaults included: onnxruntime's LeakyRelu alpha is
# 0.01f = 0.009999999776..., not the double 0.01 (a 2e-8 relative difference in float64).
LEAKY_RELU_ALPHA = float(np.float32(0.01))
HARD_SIGMOID_ALPHA = float(np.float32(0.2))


@converter("Relu")
def relu(ctx, x):
    return F.relu(x)


def leaky_relu_formula(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``x`` where ``x > 0`` else ``alpha * x`` (torch's gradient at 0 is ``alpha`` too)."""
    return torch.where(x > 0, x, x * alpha)


def _expm1_negative(x: torch.Tensor) -> torch.Tensor:
    """``exp(x) - 1`` for the non-positive branch, with no overflow where ``x`` is large. A
    ``where``, not ``clamp(x, max=0)``: clamp's gradient is 0 at its bound, which would zero
    the branch's derivative at ``x = 0`` (torch's ``elu_backward`` gives ``alpha`` there)."""
    return torch.exp(torch.where(x > 0, torch.zeros_like(x), x)) - 1


def elu_formula(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """ELU: ``x`` where ``x > 0`` else ``alpha * (exp(x) - 1)``, as ``F.elu``."""
    return torch.where(x > 0, x, alpha * _expm1_negative(x))


@converter("LeakyRelu")
def leaky_relu(ctx, x):
    return leaky_relu_formula(x, ctx.attr("alpha", LEAKY_RELU_ALPHA))


@converter("PRelu")
def prelu(ctx, x, slope):
    """``x`` where ``x > 0`` else ``slope * x``: at 0 the gradient is ``slope``, as ``F.prelu``."""
    return torch.where(x > 0, x, x * slope)


@converter("Elu")
def elu(ctx, x):
    return elu_formula(x, ctx.attr("alpha", 1.0))


@converter("Celu")
def celu(ctx, x):
    alpha = ctx.attr("alpha", 1.0)
    return torch.where(x > 0, x, alpha * _expm1_negative(x / alpha))


@converter("Selu")
def selu(ctx, x):
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    return gamma * elu_formula(x, alpha)


@converter("ThresholdedRelu")
def thresholded_relu(ctx, x):
    return torch.where(x > ctx.attr("alpha", 1.0), x, torch.zeros_like(x))


@converter("Sigmoid")
def sigmoid(ctx, x):
    return torch.sigmoid(x)


# HardSigmoid and HardSwish are spelled with Where rather than clamp: the gradient at exactly the bounds
# (h = 0 and h = 1) is then torch's for F.hardsigmoid / F.hardswish (the outer branch's) whatever clamp's
# own convention at a bound is in the installed torch.
@converter("HardSigmoid")
def hard_sigmoid(ctx, x):
    h = ctx.attr("alpha", HARD_SIGMOID_ALPHA) * x + ctx.attr("beta", 0.5)
    return torch.where(h <= 0.0, torch.zeros_like(h), torch.where(h >= 1.0, torch.ones_like(h), h))


@converter("HardSwish")
def hard_swish(ctx, x):
    h = x / 6.0 + 0.5
    return torch.where(h <= 0.0, torch.zeros_like(x), torch.where(h >= 1.0, x, x * h))


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
def convert_softmax(ctx, x):
    return _coerced(ctx, x, lambda t, axis: torch.softmax(t, axis))


@converter("LogSoftmax")
def convert_log_softmax(ctx, x):
    return _coerced(ctx, x, lambda t, axis: torch.log_softmax(t, axis))


@converter("Hardmax")
def hardmax(ctx, x):
    axis = _softmax_axis(ctx, x)
    index = torch.argmax(x, dim=axis, keepdim=True)
    return torch.zeros_like(x).scatter(axis, index, 1.0)


@converter("Shrink")
def shrink(ctx, x):
    """``x + bias`` below ``-lambd``, ``x - bias`` above ``lambd``, 0 between."""
    lambd, bias = ctx.attr("lambd", 0.5), ctx.attr("bias", 0.0)
    y = torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, torch.zeros_like(x)))
    return y.to(x.dtype)
