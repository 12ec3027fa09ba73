"""Folding of shape computations whose values are partly symbolic (dynamic batch and other dims).

With a symbolic batch, ``Shape(x)`` is a numpy object array such as ``[s0, 3, 32, 32]``
(``s0`` a ``torch.SymInt``; a symbolic sequence length is another such symbol). The shape arithmetic that exporters build on it
(Gather/Concat/Unsqueeze/Slice/Mul/... -> Reshape) is evaluated here on those arrays, so the
consumers still receive concrete-or-symbolic sizes instead of traced int tensors.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import onnx
import sympy
import torch

from ...errors import ShapeError
from .registry import NodeContext


def is_symbolic(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == object


def _axes(ctx: NodeContext, axes_input) -> list[int]:
    if axes_input is not None:
        return ctx.ints(axes_input)
    return list(ctx.attr("axes", []))


def _gather(ctx, data, indices):
    return np.take(data, np.asarray(indices, dtype=np.int64), axis=ctx.attr("axis", 0))


def _concat(ctx, *parts):
    return np.concatenate([np.asarray(p, dtype=object).reshape(-1) if np.ndim(p) == 0 else np.asarray(p, dtype=object) for p in parts], axis=ctx.attr("axis", 0))


def _unsqueeze(ctx, data, axes=None):
    result = np.asarray(data, dtype=object)
    for axis in sorted(a % (result.ndim + len(_axes(ctx, axes))) for a in _axes(ctx, axes)):
        result = np.expand_dims(result, axis)
    return result


def _squeeze(ctx, data, axes=None):
    axes = _axes(ctx, axes)
    return np.squeeze(data, axis=tuple(axes)) if axes else np.squeeze(data)


def _slice(ctx, data, starts, ends, axes=None, steps=None):
    index = [slice(None)] * data.ndim
    axes = ctx.ints(axes) if axes is not None else list(range(len(starts)))
    steps = ctx.ints(steps) if steps is not None else [1] * len(axes)
    for start, end, axis, step in zip(ctx.ints(starts), ctx.ints(ends), axes, steps, strict=True):
        index[axis] = slice(start, end, step)
    return data[tuple(index)]


def _reshape(ctx, data, shape):
    """ONNX Reshape (0 copies the input dim, -1 is inferred) on a shape array."""
    dims = [data.shape[i] if d == 0 and not ctx.attr("allowzero", 0) else d for i, d in enumerate(ctx.ints(shape))]
    return np.reshape(data, dims)


def _elementwise(fn: Callable) -> Callable:
    return lambda ctx, a, b: np.asarray(fn(np.asarray(a, dtype=object), np.asarray(b, dtype=object)), dtype=object)


def _expr(value):
    """A size as a sympy expression (a SymInt's own; a number as a sympy Integer)."""
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def _decide(ctx: NodeContext, a, b, relation: Callable) -> bool:
    """``relation(a, b)`` as a bool when it holds for every size the symbols can take (each one >= 1);
    a relation that depends on the sizes is refused: folding it at the traced size would fix it."""
    if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt):
        return bool(relation(a, b))
    decided = relation(_expr(a), _expr(b))
    if decided in (sympy.true, sympy.false):
        return bool(decided)
    raise ShapeError(
        f"{ctx.node.op_type} node '{ctx.name}' compares the symbolic size {a} with {b}, whose result depends on "
        "the size (bridge folds shape computations to one graph for every size); keep that dim static "
        "(dynamic_batch=False, or dynamic_dims= without it)"
    )


def _compare(relation: Callable) -> Callable:
    def fold(ctx, a, b):
        a, b = np.broadcast_arrays(np.asarray(a, dtype=object), np.asarray(b, dtype=object))
        return np.asarray([_decide(ctx, x, y, relation) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True)],
                          dtype=bool).reshape(a.shape)
    return fold


def _extreme(larger: bool) -> Callable:
    """Max (``larger``) or Min of sizes: one of the operands, where the order holds for every size."""
    def pick(ctx, x, y):
        return x if _decide(ctx, x, y, sympy.Ge if larger else sympy.Le) else y

    def fold(ctx, *args):
        result = np.asarray(args[0], dtype=object)
        for arg in args[1:]:
            a, b = np.broadcast_arrays(result, np.asarray(arg, dtype=object))
            result = np.asarray([pick(ctx, x, y) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True)],
                                dtype=object).reshape(a.shape)
        return result
    return fold


def _where(ctx, cond, a, b):
    return np.asarray(np.where(np.asarray(cond, dtype=bool), a, b), dtype=object)


FOLDERS: dict[str, Callable] = {
    "Identity": lambda ctx, x: x,
    "Shape": lambda ctx, x: np.asarray(np.shape(x), dtype=np.int64)[ctx.attr("start", 0):ctx.attr("end", None)],
    "Size": lambda ctx, x: np.asarray(np.size(x), dtype=np.int64),
    "Reshape": _reshape,
    "Cast": lambda ctx, x: x,
    "Gather": _gather,
    "Concat": _concat,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Add": _elementwise(operator.add),
    "Sub": _elementwise(operator.sub),
    "Mul": _elementwise(operator.mul),
    "Div": _elementwise(operator.floordiv),
    "Mod": _elementwise(operator.mod),
    "Equal": _compare(sympy.Eq),
    "Less": _compare(sympy.Lt),
    "LessOrEqual": _compare(sympy.Le),
    "Greater": _compare(sympy.Gt),
    "GreaterOrEqual": _compare(sympy.Ge),
    "Not": lambda ctx, x: np.logical_not(np.asarray(x, dtype=bool)),
    "Max": _extreme(True),
    "Min": _extreme(False),
    "Neg": lambda ctx, x: -np.asarray(x, dtype=object),
    "Where": _where,
    "ReduceProd": lambda ctx, x, axes=None: np.asarray(np.prod(x, keepdims=bool(ctx.attr("keepdims", 1))), dtype=object),
}


# Ops that pick from or rearrange their first input by the others: folded on a shape array only.
# On a constant tensor with symbolic bounds (a position table sliced to the sequence length) they
# are traced, so the bound stays symbolic (numpy would turn it into a number).
_INDEXING = {"Slice", "Gather", "Reshape"}


def folds_symbolic(op_type: str, args: list) -> bool:
    """True when a node whose arguments involve symbolic sizes is folded here (else it is traced)."""
    return op_type in FOLDERS and (op_type not in _INDEXING or is_symbolic(args[0]))


def fold_symbolic(ctx: NodeContext, args: list) -> list:
    """Evaluate a shape-arithmetic node over (partly) symbolic numpy object arrays."""
    folder = FOLDERS.get(ctx.node.op_type)
    if folder is None:
        raise ShapeError(
            f"{ctx.node.op_type} node '{ctx.name}' computes on the symbolic batch size (or another symbolic "
            "dim), which bridge cannot carry through this op; keep that dim static (dynamic_batch=False, or "
            "dynamic_dims= without it)"
        )
    result = np.asarray(folder(ctx, *args), dtype=object)
    if not any(isinstance(v, (torch.SymInt, torch.SymBool)) for v in result.reshape(-1)):
        return [_concrete(ctx, result)]  # e.g. a static dim picked out of a symbolic shape
    return [result]


def _concrete(ctx: NodeContext, values: np.ndarray) -> np.ndarray:
    """Object array without symbols -> a plain numpy array of the node's output type."""
    if ctx.node.op_type == "Cast":
        return values.astype(onnx.helper.tensor_dtype_to_np_dtype(ctx.attr("to")))
    if all(isinstance(v, (bool, np.bool_)) for v in values.reshape(-1)) and values.size:
        return values.astype(np.bool_)
    return values.astype(np.int64)
