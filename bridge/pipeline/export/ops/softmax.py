"""Softmax family, written out with Exp/ReduceSum: onnx-mlir's LogSoftmax rejects axis 1,
and an explicit form keeps the max-subtraction that makes it stable."""
from __future__ import annotations

import torch

from ..builder import emits

aten = torch.ops.aten


def _shifted(b, x, dim):
    axes = b.ints([dim % x.rank])
    return b.op("Sub", x, b.op("ReduceMax", x, axes, keepdims=1)), axes


@emits(aten._softmax.default)
def emit_softmax(b, node, x, dim, half_to_float=False):
    shifted, axes = _shifted(b, x, dim)
    exp = b.op("Exp", shifted)
    return b.op("Div", exp, b.op("ReduceSum", exp, axes, keepdims=1))


@emits(aten._log_softmax.default)
def emit_log_softmax(b, node, x, dim, half_to_float=False):
    shifted, axes = _shifted(b, x, dim)
    return b.op("Sub", shifted, b.op("Log", b.op("ReduceSum", b.op("Exp", shifted), axes, keepdims=1)))


@emits(aten.logsumexp.default)
def logsumexp(b, node, x, dims, keepdim=False):
    dims = [d % x.rank for d in dims]
    axes = b.ints(dims)
    top = b.op("ReduceMax", x, axes, keepdims=1)
    total = b.op("ReduceSum", b.op("Exp", b.op("Sub", x, top)), axes, keepdims=1)
    result = b.op("Add", b.op("Log", total), top)
    return result if keepdim else b.reshape(result, list(node.meta["val"].shape))
