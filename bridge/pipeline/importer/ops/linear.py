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
    if c is not None and torch.is_autocast_enabled("cpu"):
        # torch's Linear under autocast: one addmm in the low precision, C cast too, the result rounded once
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return y


@converter("MatMul")
def convert_matmul(ctx, a, b):
    return torch.matmul(a, b)


def _explicit(equation: str) -> str:
    """``equation`` with its output spelled out (implicit mode: the letters used exactly once,
    sorted, after ``...`` if any input has one), so that inputs can be rewritten."""
    equation = equation.replace(" ", "")
    if "->" in equation:
        return equation
    letters = equation.replace("...", "").replace(",", "")
    once = sorted(c for c in set(letters) if letters.count(c) == 1)
    return equation + "->" + ("..." if "..." in equation else "") + "".join(once)


def _axis_of(term: list[str], index: int, rank: int) -> int:
    """The axis of token ``index`` of ``term`` (letters and at most one ``...``)."""
    if "..." in term and index > term.index("..."):
        return rank - (len(term) - index)
    return index


def _take_diagonals(term: str, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Remove repeated letters of one input (``bii`` -> ``bi``) by selecting the diagonal with a
    constant identity mask and a sum: ``aten.diagonal`` and its backward have no ONNX form."""
    head, dots, tail = term.partition("...")
    tokens = list(head) + ([dots] if dots else []) + list(tail)
    while True:
        letters = [t for t in tokens if t != "..."]
        repeated = next((c for c in letters if letters.count(c) > 1), None)
        if repeated is None:
            return "".join(tokens), x
        first = tokens.index(repeated)
        second = tokens.index(repeated, first + 1)
        p, q = _axis_of(tokens, first, x.dim()), _axis_of(tokens, second, x.dim())
        shape = [1] * x.dim()
        shape[p] = shape[q] = x.shape[p]
        eye = torch.eye(x.shape[p], dtype=torch.bool).reshape(shape)
        x = torch.where(eye, x, torch.zeros((), dtype=x.dtype)).sum(q)
        del tokens[second]


@converter("Einsum")
def einsum(ctx, *xs):
    inputs, output = _explicit(ctx.attr("equation")).split("->")
    terms, operands = [], []
    for term, x in zip(inputs.split(","), xs, strict=True):
        term, x = _take_diagonals(term, x)
        terms.append(term)
        operands.append(x)
    return torch.einsum(",".join(terms) + "->" + output, *operands)
