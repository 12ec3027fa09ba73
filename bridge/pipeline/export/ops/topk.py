"""Selection ATen ops: topk -> ONNX TopK (K a constant and the last axis, as onnx-mlir requires)."""
from __future__ import annotations

import torch

from ..builder import Value, emits

aten = torch.ops.aten


@emits(aten.topk.default)
def emit_topk(b, node, x, k, dim=-1, largest=True, sorted=True):
    """Always sorted: ONNX's order for ``sorted=0`` is unspecified, torch's sorted one is valid. Along
    the last axis only, between two Transposes otherwise: onnx-mlir lowers no other TopK
    (tests/repros/onnx_mlir_topk_inner_axis.py)."""
    axis, last = dim % x.rank, x.rank - 1
    swap = list(range(x.rank))
    swap[axis], swap[last] = last, axis
    source = x if axis == last else b.transpose(x, swap)
    selected = b.op("TopK", source, b.ints([k]), outputs=2, axis=last, largest=int(largest), sorted=1)
    results = []
    for value, val in zip(selected, node.meta["val"], strict=True):
        shape = list(Value("", val.shape).shape)
        value.shape, value.dtype = [shape[i] for i in swap], val.dtype
        if axis != last:
            value = b.transpose(value, swap)
            value.shape, value.dtype = shape, val.dtype
        results.append(value)
    return tuple(results)
