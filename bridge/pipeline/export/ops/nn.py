"""Convolution and pooling: Conv, MaxPool (values only), AveragePool.

Transposed convolutions, pooling backward, ceil_mode average pooling and adaptive pooling
are rewritten by ``bridge.pipeline.lowering`` before export, so only forward, non-transposed forms
arrive here.
"""
from __future__ import annotations

import torch

from ....errors import LoweringError
from ....geometry import per_dim, pooled_size
from ..builder import GraphBuilder, Value, emits

aten = torch.ops.aten


def _where(node) -> str:
    custom = node.meta.get("custom") or {}
    return f"FX node '{node.name}' (from ONNX node '{custom.get('layer', '')}')"


@emits(aten.convolution.default)
def emit_convolution(b: GraphBuilder, node, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise LoweringError(f"aten.convolution with transposed=True reached export at {_where(node)}; it must be lowered")
    rank = weight.rank - 2
    padding, stride, dilation = per_dim(padding, rank), per_dim(stride, rank), per_dim(dilation, rank)
    x, end_pads = _fit_to_read_extent(b, x, weight.shape[2:], stride, padding, dilation)
    inputs = [x, weight] + ([bias] if bias is not None else [])
    return b.op(
        "Conv", *inputs, kernel_shape=list(weight.shape[2:]), strides=stride,
        pads=padding + end_pads, dilations=dilation, group=groups,
    )


def _read_extent(size: int, k: int, s: int, p: int, d: int) -> int:
    """How far past the begin padding the windows of a Conv read: ``(windows - 1) * s + d * (k - 1) + 1``."""
    return (pooled_size(size, k, s, p, d, False) - 1) * s + d * (k - 1) + 1


def _fit_to_read_extent(b: GraphBuilder, x: Value, kernel, stride, padding, dilation) -> tuple[Value, list[int]]:
    """The input and end pads whose padded extent is exactly what the windows read.

    Same result; it avoids an IREE defect: a strided Conv whose windows leave the end of the
    padded input unread fails to compile when its output is 1 wide along that axis (e.g. a 3x3
    kernel, stride 2, padding 1 on a 2x2 input: ``inferred ... dimension #2 to be 4, but found 3``).
    The end pad shrinks to what is read; where even the input's tail is unread, it is sliced off.
    """
    ends, sizes = [], []
    for size, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation, strict=True):
        end = _read_extent(size, k, s, p, d) - p - size
        ends.append(max(end, 0))
        sizes.append(size + min(end, 0))
    if sizes == list(x.shape[2:]):
        return x, ends
    axes = list(range(2, x.rank))
    return b.op("Slice", x, b.ints([0] * len(axes)), b.ints(sizes), b.ints(axes),
                shape=list(x.shape[:2]) + sizes, dtype=x.dtype), ends


def _indices_used(node) -> bool:
    return any(user.args[1] == 1 and user.users for user in node.users)


def _batched(b: GraphBuilder, x: Value, rank: int) -> Value:
    return x if x.rank == rank + 2 else b.reshape(x, [1] + list(x.shape))


@emits(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def emit_max_pool(b: GraphBuilder, node, x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    """MaxPool with its single output; windows that ceil_mode adds get an explicit -inf Pad."""
    if _indices_used(node):
        raise LoweringError(
            f"the Indices output of {node.target} is used at {_where(node)}; onnx-mlir's MaxPool has a single output"
        )
    rank = 2 if node.target is aten.max_pool2d_with_indices.default else 3
    kernel = per_dim(kernel_size, rank)
    stride = per_dim(stride, rank) if stride else kernel
    padding, dilation = per_dim(padding, rank), per_dim(dilation, rank)
    batched = _batched(b, x, rank)
    extra = []
    for size, k, s, p, d in zip(batched.shape[2:], kernel, stride, padding, dilation, strict=True):
        out = pooled_size(size, k, s, p, d, ceil_mode)
        extra.append(max(0, (out - 1) * s + d * (k - 1) + 1 - size - 2 * p))
    if any(extra):
        pads = b.ints([0] * (rank + 2) + [0, 0] + extra)
        batched = b.op("Pad", batched, pads, b.scalar(float("-inf"), x.dtype), mode="constant")
    y = b.op("MaxPool", batched, kernel_shape=kernel, strides=stride, pads=padding + padding, dilations=dilation)
    values = b.reshape(y, list(node.meta["val"][0].shape))
    return values, None


@emits(aten.avg_pool2d.default, aten.avg_pool3d.default)
def emit_avg_pool(b: GraphBuilder, node, x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
             divisor_override=None):
    """AveragePool; the lowering has already rewritten windows added by ceil_mode and divisor_override."""
    rank = 2 if node.target is aten.avg_pool2d.default else 3
    kernel = per_dim(kernel_size, rank)
    stride = per_dim(stride, rank) if stride else kernel
    padding = per_dim(padding, rank)
    batched = _batched(b, x, rank)
    y = b.op("AveragePool", batched, kernel_shape=kernel, strides=stride, pads=padding + padding,
             count_include_pad=int(bool(count_include_pad)))
    return b.reshape(y, list(node.meta["val"].shape))
