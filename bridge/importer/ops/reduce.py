"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/LogSum/LogSumExp/SumSquare, ArgMax/ArgMin."""
from __future__ import annotations

import torch

from ..registry import converter

_AXES_AS_INPUT_SINCE = {"ReduceSum": 13}  # every other Reduce* takes axes as input from 18


def _axes(ctx, x, axes_input) -> list[int] | None:
    since = _AXES_AS_INPUT_SINCE.get(ctx.node.op_type, 18)
    axes = (None if axes_input is None else ctx.ints(axes_input)) if ctx.opset >= since else ctx.attr("axes")
    if not axes:
        if ctx.attr("noop_with_empty_axes", 0):
            return []
        return list(range(x.dim()))
    return [a % x.dim() for a in axes] if x.dim() else []


def _reduce(fn):
    def convert(ctx, x, axes_input=None):
        axes = _axes(ctx, x, axes_input)
        if axes == [] and ctx.attr("noop_with_empty_axes", 0):
            return x
        keep = bool(ctx.attr("keepdims", 1))
        return fn(x, axes, keep)

    return convert


def _amax(x, axes, keep):
    return torch.amax(x, dim=axes, keepdim=keep)


def _amin(x, axes, keep):
    return torch.amin(x, dim=axes, keepdim=keep)


def _prod(x, axes, keep):
    for axis in sorted(axes, reverse=True):
        x = torch.prod(x, dim=axis, keepdim=True)
    return x if keep else x.squeeze(axes) if axes else x


_REDUCTIONS = {
    "ReduceSum": lambda x, a, k: torch.sum(x, dim=a, keepdim=k),
    "ReduceMean": lambda x, a, k: torch.mean(x, dim=a, keepdim=k),
    "ReduceMax": _amax,
    "ReduceMin": _amin,
    "ReduceProd": _prod,
    "ReduceL1": lambda x, a, k: torch.sum(torch.abs(x), dim=a, keepdim=k),
    "ReduceL2": lambda x, a, k: torch.sqrt(torch.sum(x * x, dim=a, keepdim=k)),
    "ReduceSumSquare": lambda x, a, k: torch.sum(x * x, dim=a, keepdim=k),
    "ReduceLogSum": lambda x, a, k: torch.log(torch.sum(x, dim=a, keepdim=k)),
    "ReduceLogSumExp": lambda x, a, k: torch.logsumexp(x, dim=a, keepdim=k),
}

for _op, _fn in _REDUCTIONS.items():
    converter(_op, static=(1,))(_reduce(_fn))


@converter("ArgMax", "ArgMin")
def arg_extreme(ctx, x):
    axis, keep = ctx.attr("axis", 0), bool(ctx.attr("keepdims", 1))
    if ctx.attr("select_last_index", 0):
        flipped = torch.flip(x, [axis])
        fn = torch.argmax if ctx.node.op_type == "ArgMax" else torch.argmin
        return x.shape[axis] - 1 - fn(flipped, dim=axis, keepdim=keep)
    fn = torch.argmax if ctx.node.op_type == "ArgMax" else torch.argmin
    return fn(x, dim=axis, keepdim=keep)


@converter("CumSum", static=(1,))
def cumsum(ctx, x, axis):
    axis = ctx.ints(axis)[0] % x.dim()
    if ctx.attr("reverse", 0):
        x = torch.flip(x, [axis])
    y = torch.cumsum(x, axis)
    if ctx.attr("exclusive", 0):
        y = y - x
    return torch.flip(y, [axis]) if ctx.attr("reverse", 0) else y
