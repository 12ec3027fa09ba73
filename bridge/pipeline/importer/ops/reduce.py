"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare, ArgMax/ArgMin.

Each Reduce* is ``post(reduce(pre(x)))`` (ReduceL1 = sum . abs), as the ONNX reference
defines it; ReduceL2 is ``lp_norm``, whose gradient at a zero slice is torch's (0).
``noop_with_empty_axes`` with no axes reduces over NO axis, so the element-wise parts still apply (ReduceL1 -> ``|x|``, ReduceLogSum -> ``log x``), as in
onnxruntime. Reducing an empty axis gives the empty set's identity: 0 (sums), 1 (product),
``-inf``/``+inf`` (ReduceMax/ReduceMin; the dtype's min/max for integers), ``-inf``
(ReduceLogSumExp) and NaN for ReduceMean (0/0; the ONNX reference's numpy mean, while
onnxruntime returns 0).

ReduceMax/ReduceMin are ``torch.amax``/``torch.amin``, whose gradient is split EVENLY among
tied maxima (``grad * (x == y) / count``). torch's own formula counts ties with a bool -> int64
sum and Casts, which onnx-mlir rejects; ``_Extremum`` computes the same gradient with a
float mask built by ``Where`` (GlobalMaxPool, a max pool, instead routes the whole gradient
to the FIRST maximum, as ``max_pool2d`` does).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..registry import converter

_AXES_AS_INPUT_SINCE = {"ReduceSum": 13}  # every other Reduce* takes axes as input from 18


def _axes(ctx, x, axes_input) -> list[int]:
    """The reduced axes (non-negative); ``[]`` means no reduction (``noop_with_empty_axes``)."""
    since = _AXES_AS_INPUT_SINCE.get(ctx.node.op_type, 18)
    axes = (None if axes_input is None else ctx.ints(axes_input)) if ctx.opset >= since else ctx.attr("axes")
    if not axes:
        return [] if ctx.attr("noop_with_empty_axes", 0) else list(range(x.dim()))
    return [a % x.dim() for a in axes] if x.dim() else []


class _Extremum(torch.autograd.Function):
    """``amax``/``amin`` with torch's gradient (even split among ties) and no int Casts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axes: list[int], largest: bool) -> torch.Tensor:
        y = (torch.amax if largest else torch.amin)(x, dim=axes, keepdim=True)
        ctx.save_for_backward(x, y)
        ctx.axes = axes
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        one, zero = torch.ones((), dtype=x.dtype), torch.zeros((), dtype=x.dtype)
        ties = torch.where(x == y, one, zero)
        return grad * ties / torch.sum(ties, dim=ctx.axes, keepdim=True), None, None


def extremum(largest: bool):
    def reduce(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
        if not x.dtype.is_floating_point:
            return (torch.amax if largest else torch.amin)(x, dim=axes, keepdim=True)
        return _Extremum.apply(x, axes, largest)

    return reduce


class _PNorm(torch.autograd.Function):
    """``(sum |x|^p) ** (1/p)`` over ``axes`` (p >= 2) with torch's gradient at a zero slice: 0,
    as ``torch.linalg.vector_norm`` and ``F.lp_pool2d`` (the chain rule through ``sqrt`` gives
    ``0 * inf = NaN`` there)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axes: list[int], p: float) -> torch.Tensor:
        y = torch.sum(x * x if p == 2 else torch.abs(x) ** p, dim=axes, keepdim=True) ** (1 / p)
        ctx.save_for_backward(x, y)
        ctx.p = p
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        zero = y == 0
        safe = torch.where(zero, torch.ones_like(y), y)
        ratio = x / safe if ctx.p == 2 else torch.sign(x) * (torch.abs(x) / safe) ** (ctx.p - 1)
        return torch.where(zero, torch.zeros_like(x), grad * ratio), None, None


def lp_norm(x: torch.Tensor, axes: list[int], p: float) -> torch.Tensor:
    """The p-norm over ``axes`` (kept), p >= 1, with torch's gradient at a zero slice (0)."""
    if p == 1:
        return torch.sum(torch.abs(x), dim=axes, keepdim=True)
    return _PNorm.apply(x, axes, p)


def _prod(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    for axis in axes:
        x = torch.prod(x, dim=axis, keepdim=True)
    return x


def _sum(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    return torch.sum(x, dim=axes, keepdim=True)


def _empty_max(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return -torch.inf if dtype.is_floating_point else torch.iinfo(dtype).min


def _empty_min(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    return torch.inf if dtype.is_floating_point else torch.iinfo(dtype).max


class _Reduction(NamedTuple):
    """``post(reduce(pre(x), axes))``; ``empty``: the value over an empty set (None: reduce's own)."""

    reduce: Callable[[torch.Tensor, list[int]], torch.Tensor]
    pre: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    post: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    empty: Callable[[torch.dtype], float] | None = None
    pointwise: Callable[[torch.Tensor], torch.Tensor] | None = None  # with no axes (default: post . pre)


_REDUCTIONS = {
    "ReduceSum": _Reduction(_sum),
    "ReduceMean": _Reduction(lambda x, a: torch.mean(x, dim=a, keepdim=True)),
    "ReduceMax": _Reduction(extremum(True), empty=_empty_max),
    "ReduceMin": _Reduction(extremum(False), empty=_empty_min),
    "ReduceProd": _Reduction(_prod),
    "ReduceL1": _Reduction(_sum, pre=torch.abs),
    "ReduceL2": _Reduction(lambda x, a: lp_norm(x, a, 2), pointwise=torch.abs),
    "ReduceSumSquare": _Reduction(_sum, pre=lambda x: x * x),
    "ReduceLogSum": _Reduction(_sum, post=torch.log),
    "ReduceLogSumExp": _Reduction(lambda x, a: torch.logsumexp(x, dim=a, keepdim=True)),
}


def _reduce(reduction: _Reduction):
    def convert(ctx, x, axes_input=None):
        axes = _axes(ctx, x, axes_input)
        if not axes:
            return reduction.pointwise(x) if reduction.pointwise else reduction.post(reduction.pre(x))
        if reduction.empty is not None and any(x.shape[a] == 0 for a in axes):
            shape = [1 if i in axes else size for i, size in enumerate(x.shape)]
            y = torch.full(shape, reduction.empty(x.dtype), dtype=x.dtype)
        else:
            y = reduction.post(reduction.reduce(reduction.pre(x), axes))
        return y if ctx.attr("keepdims", 1) else y.squeeze(axes)

    return convert


for _op, _reduction in _REDUCTIONS.items():
    converter(_op, static=(1,))(_reduce(_reduction))


@converter("ArgMax", "ArgMin")
def convert_arg_extreme(ctx, x):
    axis, keep = ctx.attr("axis", 0), bool(ctx.attr("keepdims", 1))
    if ctx.attr("select_last_index", 0):
        flipped = torch.flip(x, [axis])
        fn = torch.argmax if ctx.node.op_type == "ArgMax" else torch.argmin
        return x.shape[axis] - 1 - fn(flipped, dim=axis, keepdim=keep)
    fn = torch.argmax if ctx.node.op_type == "ArgMax" else torch.argmin
    return fn(x, dim=axis, keepdim=keep)


@converter("CumSum", static=(1,))
def convert_cumsum(ctx, x, axis):
    axis = ctx.ints(axis)[0] % x.dim()
    if ctx.attr("reverse", 0):
        x = torch.flip(x, [axis])
    y = torch.cumsum(x, axis, dtype=x.dtype)
    if ctx.attr("exclusive", 0):
        y = y - x
    return torch.flip(y, [axis]) if ctx.attr("reverse", 0) else y
