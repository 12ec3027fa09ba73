"""Matrix products: mm, bmm, addmm, matmul.

A 2-D product one of whose operands is a transposed matrix is a ``Gemm`` reading that matrix as
it is (``transA``/``transB``): no Transpose is run (onnxruntime's Gemm packs either layout), and
``addmm`` adds its bias in the same Gemm. Under ``long_inner_gemm`` (bridge/pipeline/targets.py) a product
of a long inner dimension is a Gemm too, and under ``explicit_transposes`` (``runs_transposes``) a transposed
operand is read from its Transpose: no ``transA``, and no ``transB`` where the product is a MatMul."""
from __future__ import annotations

import torch

from ...targets import product_is_gemm, runs_transposes
from ..builder import emits

aten = torch.ops.aten


@emits(aten.mm.default)
def mm(b, node, a, other):
    if node.meta["val"].dtype.is_floating_point:  # onnxruntime's Gemm: float types only
        (a_source, trans_a), (other_source, trans_b) = b.matrix(a), b.matrix(other)
        inner, columns = node.args[1].meta["val"].shape
        long_inner = product_is_gemm(inner, columns)
        if runs_transposes(inner, columns):  # read from the Transposes: no transA, and no transB in a MatMul
            a_source, trans_a = a, 0
            if not long_inner:
                other_source, trans_b = other, 0
        if trans_a or trans_b or long_inner:
            return b.op("Gemm", a_source, other_source, transA=trans_a or None, transB=trans_b or None)
    return b.op("MatMul", a, other)


@emits(aten.bmm.default, aten.matmul.default)
def emit_matmul(b, node, a, other):
    return b.op("MatMul", a, other)


@emits(aten.addmm.default)
def addmm(b, node, bias, a, other, beta=1, alpha=1):
    if node.meta["val"].dtype.is_floating_point:  # onnxruntime's Gemm: float types only
        (a, trans_a), (other, trans_b) = b.matrix(a), b.matrix(other)
        return b.op("Gemm", a, other, bias, transA=trans_a or None, transB=trans_b or None,
                    alpha=None if alpha == 1 else float(alpha), beta=None if beta == 1 else float(beta))
    product = b.op("MatMul", a, other)
    if alpha != 1:
        product = b.op("Mul", product, b.scalar(alpha, product.dtype or a.dtype))
    if beta != 1:
        bias = b.op("Mul", bias, b.scalar(beta, a.dtype))
    return b.op("Add", product, bias)
