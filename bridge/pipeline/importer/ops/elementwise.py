"""Element-wise ONNX ops: arithmetic, comparison, logic, casts and unary math."""
from __future__ import annotations

import numpy as np
import onnx
import torch

from ....dtypes import ONNX_TO_TORCH, TORCH_TO_NUMPY
from ..program import _to_tensor
from ..registry import converter
from ..shape_folding import is_symbolic

_BINARY = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Equal": torch.eq,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
    "BitwiseXor": torch.bitwise_xor,
}

_UNARY = {
    "Neg": torch.neg,
    "Abs": torch.abs,
    "Exp": torch.exp,
    "Log": torch.log,
    "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,
    "Sign": torch.sign,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": torch.atanh,
    "Erf": torch.erf,
    "Not": torch.logical_not,
    "BitwiseNot": torch.bitwise_not,
    "IsNaN": torch.isnan,
}


def _binary(fn):
    return lambda ctx, a, b: fn(a, b)


def _unary(fn):
    return lambda ctx, x: fn(x)


for _op, _fn in _BINARY.items():
    converter(_op)(_binary(_fn))
for _op, _fn in _UNARY.items():
    converter(_op)(_unary(_fn))


@converter("Div")
def convert_div(ctx, a, b):
    if a.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


@converter("Mod")
def mod(ctx, a, b):
    return torch.fmod(a, b) if ctx.attr("fmod", 0) else torch.remainder(a, b)


@converter("Pow")
def pow_(ctx, a, b):
    return torch.pow(a, b.to(a.dtype) if b.dtype != a.dtype else b)


@converter("Max", "Min", "Sum", "Mean")
def variadic(ctx, *xs):
    op = ctx.node.op_type
    result = xs[0]
    for x in xs[1:]:
        if op == "Max":
            result = torch.maximum(result, x)
        elif op == "Min":
            result = torch.minimum(result, x)
        else:
            result = result + x
    return result / len(xs) if op == "Mean" else result


@converter("Where")
def convert_where(ctx, cond, a, b):
    return torch.where(cond, a, b)


@converter("IsInf")
def convert_isinf(ctx, x):
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    if pos and neg:
        return torch.isinf(x)
    return torch.isposinf(x) if pos else torch.isneginf(x)


class _Clamp(torch.autograd.Function):
    """``torch.clamp`` with constant bounds and torch's gradient for number bounds: the gradient
    passes strictly inside ``(low, high)`` and is 0 at a bound (``F.relu6``, ``F.hardtanh``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, low, high) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.low, ctx.high = low, high
        return torch.clamp(x, low, high)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        inside = torch.ones_like(x, dtype=torch.bool)
        if ctx.low is not None:
            inside = inside & (x > ctx.low)
        if ctx.high is not None:
            inside = inside & (x < ctx.high)
        return torch.where(inside, grad, torch.zeros_like(grad)), None, None


def _trained(bound) -> bool:
    return isinstance(bound, torch.Tensor) and bound.requires_grad


@converter("Clip")
def clip(ctx, x, low=None, high=None):
    """``clamp(x, low, high)``; with constant bounds the gradient is 0 at a bound, as torch gives
    for number bounds (a trained bound keeps ``torch.clamp``'s own gradients)."""
    if ctx.opset < 11:
        low, high = ctx.attr("min"), ctx.attr("max")
    if low is None and high is None:  # no bound: the identity
        return x
    if not x.dtype.is_floating_point or _trained(low) or _trained(high):
        return torch.clamp(x, low, high)
    return _Clamp.apply(x, low, high)


def onnx_to_torch_dtype(onnx_type: int) -> torch.dtype:
    """The torch dtype of ONNX element type ``onnx_type`` (``bridge.dtypes``)."""
    return ONNX_TO_TORCH[onnx_type]


# Unsigned types that the importer computes as int64 (importer/program.py WIDE_UNSIGNED): a Cast
# to one of them wraps modulo 2**bits as ONNX's Cast does.
_UNSIGNED_BITS = {onnx.TensorProto.UINT16: 16, onnx.TensorProto.UINT32: 32, onnx.TensorProto.UINT64: 64}


@converter("Cast")
def cast(ctx, x):
    to = ctx.attr("to")
    if to in _UNSIGNED_BITS:
        wide = x.to(torch.int64)
        return wide if _UNSIGNED_BITS[to] == 64 else torch.bitwise_and(wide, (1 << _UNSIGNED_BITS[to]) - 1)
    return x.to(onnx_to_torch_dtype(to))


@converter("CastLike", raw=True)
def cast_like(ctx, x, like):
    """``x`` in ``like``'s type; an ``x`` known before the model runs is cast at import (a constant:
    no int -> float Cast reaches the graph, e.g. AffineGrid's expansion casting a Range to theta's type)."""
    like = _to_tensor(like) if isinstance(like, np.ndarray) else like
    if isinstance(x, np.ndarray) and not is_symbolic(x):
        return x.astype(TORCH_TO_NUMPY[like.dtype])
    return (_to_tensor(x) if isinstance(x, np.ndarray) else x).to(like.dtype)


@converter("BitShift")
def bit_shift(ctx, x, y):
    """Unsigned shifts (uint16/32/64 are computed as int64: exact below 2**63)."""
    if x.dtype != y.dtype:  # a uint16/32/64 constant next to a widened (int64) value
        x, y = x.to(torch.int64), y.to(torch.int64)
    left = ctx.attr("direction") == "LEFT"
    return torch.bitwise_left_shift(x, y) if left else torch.bitwise_right_shift(x, y)
