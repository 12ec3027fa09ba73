"""Matrix products: mm, bmm, addmm, matmul."""
from __future__ import annotations

import torch

from ..builder import emits

aten = torch.ops.aten


@emits(aten.mm.default, aten.bmm.default, aten.matmul.default)
def emit_matmul(b, node, a, other):
    return b.op("MatMul", a, other)


@emits(aten.addmm.default)
def addmm(b, node, bias, a, other, beta=1, alpha=1):
    product = b.op("MatMul", a, other)
    if alpha != 1:
        product = b.op("Mul", product, b.scalar(alpha, product.dtype or a.dtype))
    if beta != 1:
        bias = b.op("Mul", bias, b.scalar(beta, a.dtype))
    return b.op("Add", product, bias)
