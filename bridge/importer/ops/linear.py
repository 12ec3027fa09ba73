"""Matrix products: Gemm, MatMul, Einsum."""
from __future__ import annotations

import torch

from ..registry import converter


@converter("Gemm")
def gemm(ctx, a, b, c=None):
    """Y = alpha * A' @ B' + beta * C, alpha and beta kept as ops (not folded into weights)."""
    if ctx.attr("transA", 0):
        a = a.transpose(0, 1)
    if ctx.attr("transB", 0):
        b = b.transpose(0, 1)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return y


@converter("MatMul")
def matmul(ctx, a, b):
    return torch.matmul(a, b)


@converter("Einsum")
def einsum(ctx, *xs):
    return torch.einsum(ctx.attr("equation"), *xs)
