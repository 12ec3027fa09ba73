"""Selection ATen ops: topk -> ONNX TopK (K a constant, as onnx-mlir requires)."""
from __future__ import annotations

import torch

from ..builder import Value, emits

aten = torch.ops.aten


@emits(aten.topk.default)
def emit_topk(b, node, x, k, dim=-1, largest=True, sorted=True):
    """Always sorted: ONNX's order for ``sorted=0`` is unspecified, torch's sorted one is valid."""
    values, indices = b.op("TopK", x, b.ints([k]), outputs=2, axis=dim % x.rank, largest=int(largest), sorted=1)
    for value, val in zip((values, indices), node.meta["val"], strict=True):
        value.shape, value.dtype = Value("", val.shape).shape, val.dtype
    return values, indices
