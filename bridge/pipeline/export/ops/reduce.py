"""Reductions. onnx-mlir reduces only with keepdims=1 and explicit axes, so every reduction
is emitted that way and followed by a Reshape when torch drops the reduced dims."""
from __future__ import annotations

import numpy as np
import torch

from ..builder import GraphBuilder, Value, emits, is_static

aten = torch.ops.aten


def _reduce(b: GraphBuilder, node, onnx_op: str, x: Value, dims, keepdim: bool, dtype=None) -> Value:
    x = b.cast(x, dtype or node.meta["val"].dtype)
    if x.rank == 0:
        return x
    dims = list(range(x.rank)) if dims is None or len(dims) == 0 else [d % x.rank for d in dims]
    flattened = len(set(dims)) == x.rank > 1
    if flattened:
        # Over every axis: flatten first. IREE miscompiles Mul-by-a-broadcast-vector followed by
        # a ReduceSum over all axes (e.g. a class-weighted loss summed): a 0-d vector.contract.
        size = [int(np.prod(x.shape))] if is_static(x.shape) else None
        x = b.op("Reshape", x, b.ints([-1]), shape=size, dtype=x.dtype)
        dims, kept = [0], [1]
    else:
        kept = [1 if i in dims else d for i, d in enumerate(x.shape)]
    reduced = b.op(onnx_op, x, b.ints(dims), keepdims=1, shape=kept, dtype=x.dtype)
    # keepdim after a flatten: [1] back to [1, 1, ...] (the rank torch keeps)
    return reduced if keepdim and not flattened else b.reshape(reduced, list(node.meta["val"].shape))


# The ONNX reduction of each ATen reduction the two emitters below serve.
_ONNX_REDUCE = {aten.sum.dim_IntList: "ReduceSum", aten.sum.default: "ReduceSum", aten.mean.dim: "ReduceMean",
                aten.mean.default: "ReduceMean", aten.amax.default: "ReduceMax", aten.amin.default: "ReduceMin"}


@emits(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
def reduce_dims(b, node, x, dims=(), keepdim=False, dtype=None):
    return _reduce(b, node, _ONNX_REDUCE[node.target], x, dims, keepdim, dtype)


@emits(aten.sum.default, aten.mean.default)
def reduce_all(b, node, x, dtype=None):
    return _reduce(b, node, _ONNX_REDUCE[node.target], x, None, False, dtype)


@emits(aten.prod.dim_int)
def prod(b, node, x, dim, keepdim=False, dtype=None):
    return _reduce(b, node, "ReduceProd", x, [dim], keepdim, dtype)


@emits(aten.any.dim, aten.any.dims, aten.any.default)
def any_(b, node, x, dims=None, keepdim=False):
    as_float = b.cast(x, torch.float32)
    if isinstance(dims, int):
        dims = [dims]
    reduced = _reduce(b, node, "ReduceMax", as_float, dims, keepdim, torch.float32)
    return b.op("Greater", reduced, b.scalar(0, torch.float32))


@emits(aten.argmax.default, aten.argmin.default)
def emit_arg_extreme(b, node, x, dim=None, keepdim=False):
    op = "ArgMax" if node.target is aten.argmax.default else "ArgMin"
    if dim is None:
        x = b.reshape(x, [-1])
        dim = 0
    return b.op(op, x, axis=dim % x.rank, keepdims=int(keepdim))


@emits(aten.var.correction)
def var(b, node, x, dims=None, correction=None, keepdim=False):
    dims = list(range(x.rank)) if not dims else [d % x.rank for d in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    correction = 1 if correction is None else correction
    mean = b.op("ReduceMean", x, b.ints(dims), keepdims=1)
    centered = b.op("Sub", x, mean)
    squares = b.op("ReduceSum", b.op("Mul", centered, centered), b.ints(dims), keepdims=1)
    result = b.op("Div", squares, b.scalar(max(count - correction, 0), x.dtype))
    return result if keepdim else b.reshape(result, list(node.meta["val"].shape))


@emits(aten.cumsum.default)
def emit_cumsum(b, node, x, dim, dtype=None):
    x = b.cast(x, dtype or node.meta["val"].dtype)
    return b.op("CumSum", x, b.const(np.int64(dim % x.rank)))
