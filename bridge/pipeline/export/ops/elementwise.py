"""Element-wise ATen ops -> ONNX arithmetic, comparison, logic and unary math."""
from __future__ import annotations

import math
from fractions import Fraction

import torch

from ...targets import enabled
from ..builder import GraphBuilder, Value, emits

aten = torch.ops.aten


def _out_dtype(node) -> torch.dtype:
    return node.meta["val"].dtype


def _binary(onnx_op: str):
    def emit(b: GraphBuilder, node, a, other, alpha=1):
        dtype = _out_dtype(node)
        lhs, rhs = b.operand(a, dtype), b.operand(other, dtype)
        if alpha != 1:
            rhs = b.op("Mul", rhs, b.scalar(alpha, dtype))
        return b.op(onnx_op, lhs, rhs)

    return emit


for _targets, _op in (
    ((aten.add.Tensor, aten.add.Scalar), "Add"),
    ((aten.sub.Tensor, aten.sub.Scalar), "Sub"),
    ((aten.mul.Tensor, aten.mul.Scalar), "Mul"),
    ((aten.maximum.default,), "Max"),
    ((aten.minimum.default,), "Min"),
    ((aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar), "Pow"),
):
    emits(*_targets)(_binary(_op))


@emits(aten.rsub.Scalar, aten.rsub.Tensor)
def rsub(b, node, a, other, alpha=1):
    return _binary("Sub")(b, node, other, a) if alpha == 1 else b.op(
        "Sub", b.operand(other, _out_dtype(node)), b.op("Mul", a, b.scalar(alpha, _out_dtype(node)))
    )


@emits(aten.pow.Scalar)
def pow_scalar(b, node, base, exponent):
    dtype = _out_dtype(node)
    return b.op("Pow", b.scalar(base, dtype), b.operand(exponent, dtype))


@emits(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode)
def emit_div(b, node, a, other, rounding_mode=None):
    dtype = _out_dtype(node)
    if rounding_mode is None:
        return b.op("Div", b.operand(a, dtype), b.operand(other, dtype))
    if dtype.is_floating_point:
        q = b.op("Div", b.operand(a, dtype), b.operand(other, dtype))
        return b.op("Floor", q) if rounding_mode == "floor" else _trunc(b, q)
    lhs, rhs = b.operand(a, dtype), b.operand(other, dtype)
    if rounding_mode == "trunc":
        return b.op("Div", lhs, rhs)
    # floor division of integers: trunc division, minus one where signs differ and a remainder exists
    q = b.op("Div", lhs, rhs)
    rem = b.op("Sub", lhs, b.op("Mul", q, rhs))
    zero = b.scalar(0, dtype)
    negative = b.op("Xor", b.op("Less", lhs, zero), b.op("Less", rhs, zero))
    adjust = b.op("And", negative, b.op("Not", b.op("Equal", rem, zero)))
    return b.op("Where", adjust, b.op("Sub", q, b.scalar(1, dtype)), q)


_UNARY = {
    aten.neg.default: "Neg",
    aten.abs.default: "Abs",
    aten.exp.default: "Exp",
    aten.log.default: "Log",
    aten.sqrt.default: "Sqrt",
    aten.reciprocal.default: "Reciprocal",
    aten.floor.default: "Floor",
    aten.ceil.default: "Ceil",
    aten.round.default: "Round",
    aten.sign.default: "Sign",
    aten.sin.default: "Sin",
    aten.cos.default: "Cos",
    aten.tan.default: "Tan",
    aten.asin.default: "Asin",
    aten.acos.default: "Acos",
    aten.atan.default: "Atan",
    aten.sinh.default: "Sinh",
    aten.cosh.default: "Cosh",
    aten.asinh.default: "Asinh",
    aten.acosh.default: "Acosh",
    aten.atanh.default: "Atanh",
    aten.erf.default: "Erf",
    aten.sigmoid.default: "Sigmoid",
    aten.relu.default: "Relu",
    aten.logical_not.default: "Not",
    aten.bitwise_not.default: "Not",
}


def _unary(onnx_op: str):
    """Unary op; an integer input of a float op (sqrt of a size) is cast to the result type first."""
    return lambda b, node, x: b.op(onnx_op, b.cast(x, _out_dtype(node)) if _out_dtype(node).is_floating_point else x)


for _target, _op in _UNARY.items():
    emits(_target)(_unary(_op))


# tanh(x) = sum_n TANH_TAYLOR[n] * x^(2n+1): 2^(2k) (2^(2k) - 1) B_2k / (2k)! with the Bernoulli numbers B_2k
TANH_TAYLOR = tuple(Fraction(2 ** (2 * k) * (2 ** (2 * k) - 1) * bernoulli, math.factorial(2 * k)) for k, bernoulli in enumerate(
    (Fraction(1, 6), Fraction(-1, 30), Fraction(1, 42), Fraction(-1, 30), Fraction(5, 66), Fraction(-691, 2730),
     Fraction(7, 6), Fraction(-3617, 510), Fraction(43867, 798)), start=1))
TANH_TAYLOR_BELOW = 0.55  # |x| below which the 9 Taylor terms are float32-exact (the next term < 2^-25 of tanh)


@emits(aten.tanh.default)
def emit_tanh(b, node, x):
    """Tanh; with the target form ``tanh_as_exp`` a float32 tanh as ``sign(x) * (1 - 2 / (exp(2|x|) + 1))`` (1
    where exp overflows) and, where ``|x| < TANH_TAYLOR_BELOW``, as its Taylor polynomial in Horner form (the exp
    form would lose the relative precision of small values)."""
    dtype = _out_dtype(node)
    x = b.cast(x, dtype)  # an integer input: tanh of its float value
    if dtype != torch.float32 or not enabled("tanh_as_exp"):
        return b.op("Tanh", x)
    one, two, size = b.scalar(1, dtype), b.scalar(2, dtype), b.op("Abs", x)
    far = b.op("Sub", one, b.op("Div", two, b.op("Add", b.op("Exp", b.op("Mul", size, two)), one)))
    square, series = b.op("Mul", x, x), b.scalar(float(TANH_TAYLOR[-1]), dtype)
    for coefficient in reversed(TANH_TAYLOR[:-1]):
        series = b.op("Add", b.op("Mul", series, square), b.scalar(float(coefficient), dtype))
    near = b.op("Mul", x, series)
    return b.op("Where", b.op("Less", size, b.scalar(TANH_TAYLOR_BELOW, dtype)), near, b.op("Mul", b.op("Sign", x), far))


@emits(aten.rsqrt.default)
def rsqrt(b, node, x):
    return b.op("Reciprocal", b.op("Sqrt", x))


@emits(aten.log1p.default)
def log1p(b, node, x):
    return b.op("Log", b.op("Add", x, b.scalar(1, x.dtype)))


@emits(aten.expm1.default)
def expm1(b, node, x):
    return b.op("Sub", b.op("Exp", x), b.scalar(1, x.dtype))


def _trunc(b, x):
    return b.op("Mul", b.op("Sign", x), b.op("Floor", b.op("Abs", x)))


@emits(aten.trunc.default)
def trunc(b, node, x):
    return _trunc(b, x)


@emits(aten.isnan.default)
def isnan(b, node, x):
    """``x != x``: onnx-mlir's IsNaN needs opset 20 and training graphs are opset 18."""
    return b.op("Not", b.op("Equal", x, x))


@emits(aten.isinf.default)
def emit_isinf(b, node, x):
    return b.op("IsInf", x)


_COMPARE = {
    "eq": "Equal",
    "lt": "Less",
    "le": "LessOrEqual",
    "gt": "Greater",
    "ge": "GreaterOrEqual",
}


def _compare(onnx_op: str):
    def emit(b, node, a, other):
        dtype = torch.promote_types(a.dtype, other.dtype) if isinstance(other, Value) else a.dtype
        return b.op(onnx_op, b.operand(a, dtype), b.operand(other, dtype))

    return emit


for _name, _op in _COMPARE.items():
    emits(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_compare(_op))


@emits(aten.ne.Tensor, aten.ne.Scalar)
def ne(b, node, a, other):
    return b.op("Not", _compare("Equal")(b, node, a, other))


_LOGICAL = {aten.logical_and.default: "And", aten.logical_or.default: "Or", aten.logical_xor.default: "Xor"}
for _target, _op in _LOGICAL.items():
    emits(_target)(lambda b, node, a, other, _op=_op: b.op(_op, b.cast(a, torch.bool), b.cast(other, torch.bool)))


@emits(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor)
def bitwise(b, node, a, other):
    op = {"bitwise_and": "And", "bitwise_or": "Or", "bitwise_xor": "Xor"}[node.target._opname]
    if a.dtype != torch.bool:
        op = "Bitwise" + op
    return b.op(op, a, other)


@emits(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def emit_where(b, node, cond, a, other):
    dtype = _out_dtype(node)
    return b.op("Where", cond, b.operand(a, dtype), b.operand(other, dtype))


@emits(aten.clamp.default, aten.clamp.Tensor)
def clamp(b, node, x, low=None, high=None):
    """Both bounds numbers on a float tensor: one Clip (faster in onnxruntime than Max + Min; NaN and
    infinities come out as Max + Min give them); a tensor bound, one bound or an integer tensor: Max / Min."""
    dtype = _out_dtype(node)
    x = b.cast(x, dtype)
    if (low is not None and high is not None and not isinstance(low, Value) and not isinstance(high, Value)
            and dtype.is_floating_point):
        return b.op("Clip", x, b.operand(low, dtype), b.operand(high, dtype))
    if low is not None:
        x = b.op("Max", x, b.operand(low, dtype))
    if high is not None:
        x = b.op("Min", x, b.operand(high, dtype))
    return x


@emits(aten.clamp_min.default)
def clamp_min(b, node, x, low):
    return clamp(b, node, x, low=low)


@emits(aten.clamp_max.default)
def clamp_max(b, node, x, high):
    return clamp(b, node, x, high=high)


@emits(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(b, node, a, other):
    dtype = _out_dtype(node)
    return b.op("Mod", b.operand(a, dtype), b.operand(other, dtype), fmod=1)


@emits(aten.remainder.Tensor, aten.remainder.Scalar)
def remainder(b, node, a, other):
    dtype = _out_dtype(node)
    a, other = b.operand(a, dtype), b.operand(other, dtype)
    if not dtype.is_floating_point:
        return b.op("Mod", a, other, fmod=0)
    # a - floor(a / other) * other: the sign follows the divisor, as in torch.remainder
    return b.op("Sub", a, b.op("Mul", b.op("Floor", b.op("Div", a, other)), other))


@emits(aten._to_copy.default, torch.ops.prims.convert_element_type.default)
def to_copy(b, node, x, dtype=None, **_):
    return b.cast(x, dtype or _out_dtype(node))


@emits(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default, aten.copy.default,
       torch.ops.prims.copy_strided.default)
def emit_identity(b, node, x, *rest, **_):
    """Copies and aliases: values are immutable in ONNX, so these emit nothing."""
    if node.target is aten.copy.default:
        return b.cast(rest[0], x.dtype)
    return x
