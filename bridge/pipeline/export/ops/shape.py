"""Views and data movement: view/reshape, permute, expand, cat, slice, select, gather, ..."""
from __future__ import annotations

import numpy as np
import torch

from ....errors import LoweringError
from ..builder import GraphBuilder, emits, is_static

aten = torch.ops.aten


def _out_shape(node) -> list:
    """The traced output sizes: ints, or SymInts for a symbolic batch."""
    return list(node.meta["val"].shape)


@emits(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim, aten.squeeze.dims,
       aten.squeeze.default, aten.unsqueeze.default, aten.flatten.using_ints, aten.view_copy.default,
       aten._reshape_alias.default)
def emit_reshape(b: GraphBuilder, node, x, *_, **__):
    return b.reshape(x, _out_shape(node))


@emits(aten.permute.default)
def permute(b, node, x, dims):
    return b.transpose(x, [d % x.rank for d in dims])


@emits(aten.t.default, aten.numpy_T.default)
def transpose_2d(b, node, x):
    return x if x.rank < 2 else b.transpose(x, list(reversed(range(x.rank))))


@emits(aten.transpose.int)
def emit_transpose(b, node, x, dim0, dim1):
    perm = list(range(x.rank))
    perm[dim0 % x.rank], perm[dim1 % x.rank] = perm[dim1 % x.rank], perm[dim0 % x.rank]
    return b.transpose(x, perm)


@emits(aten.expand.default, aten.expand_copy.default)
def emit_expand(b, node, x, size, implicit=False):
    shape = _out_shape(node)
    if is_static(shape) and is_static(x.shape) and list(x.shape) == shape:
        return x
    return b.op("Expand", x, b.shape_tensor(shape))


@emits(aten.cat.default)
def cat(b, node, tensors, dim=0):
    tensors = [t for t in tensors if t.shape is None or 0 not in t.shape]
    if len(tensors) == 1:
        return tensors[0]
    dtype, shape = node.meta["val"].dtype, _out_shape(node)
    result = b.op("Concat", *[b.cast(t, dtype) for t in tensors], axis=dim % len(shape))
    if is_static(shape) and not all(t.shape is not None and is_static(t.shape) for t in tensors):
        # symbolic parts of a static whole (a position table's gradient: [seq] + [32 - seq] rows):
        # a Reshape states the static shape, which IREE's shape inference cannot derive
        return b.reshape(result, shape)
    return result


_END = np.iinfo(np.int64).max  # a Slice end past any length


@emits(aten.slice.Tensor, aten.slice_copy.Tensor)
def emit_slice(b, node, x, dim=0, start=None, end=None, step=1):
    """ONNX Slice, whose bounds follow torch's (negative: from the end; clamped to the axis). A
    symbolic length or bound (a sequence length) is passed as is, never compared with a number."""
    dim %= x.rank
    length = x.shape[dim]
    start = 0 if start is None else start
    end = _END if end is None else end
    if is_static([length, start, end]):
        start = max(0, min(length, start + length if start < 0 else start))
        end = max(0, min(length, end + length if end < 0 else end))
        if start == 0 and end == length and step == 1:
            return x
    elif is_static([start, end]) and start == 0 and end == _END and step == 1:
        return x
    return b.op("Slice", x, b.dim(start), b.dim(end), b.ints([dim]), b.ints([step]))


@emits(aten.select.int, aten.select_copy.int)
def select(b, node, x, dim, index):
    """A one-element Slice; a negative index counts from the end (so a symbolic length needs no value)."""
    dim %= x.rank
    stop = index + 1 if index + 1 != 0 else _END
    sliced = b.op("Slice", x, b.ints([index]), b.ints([stop]), b.ints([dim]))
    return b.reshape(sliced, _out_shape(node))


@emits(aten.split_with_sizes.default, aten.split_with_sizes_copy.default, aten.split.Tensor)
def emit_split(b, node, x, sizes, dim=0):
    dim %= x.rank
    if isinstance(sizes, int):
        sizes = [min(sizes, x.shape[dim] - i) for i in range(0, x.shape[dim], sizes)]
    outs, start = [], 0
    for size in sizes:
        outs.append(b.op("Slice", x, b.ints([start]), b.ints([start + size]), b.ints([dim])))
        start += size
    return tuple(outs)


@emits(aten.unbind.int)
def unbind(b, node, x, dim=0):
    dim %= x.rank
    shape = [d for i, d in enumerate(x.shape) if i != dim]
    return tuple(
        b.reshape(b.op("Slice", x, b.ints([i]), b.ints([i + 1]), b.ints([dim])), shape) for i in range(x.shape[dim])
    )


@emits(aten.index_select.default)
def index_select(b, node, x, dim, index):
    return b.op("Gather", x, index, axis=dim % x.rank)


@emits(aten.embedding.default)
def embedding(b, node, weight, indices, *_):
    return b.op("Gather", weight, indices, axis=0)


@emits(aten.gather.default)
def emit_gather(b, node, x, dim, index, sparse_grad=False):
    return b.op("GatherElements", x, index, axis=dim % x.rank)


@emits(aten.index.Tensor)
def index(b, node, x, indices):
    """Advanced indexing with one index tensor (the others None) -> Gather."""
    used = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(used) != 1:
        raise LoweringError(
            f"aten.index with {len(used)} index tensors (FX node '{node.name}') has no ONNX emitter; "
            "index one dim at a time (index_select) or with a flat index"
        )
    dim, idx = used[0]
    return b.op("Gather", x, idx, axis=dim)


@emits(aten.flip.default)
def flip(b, node, x, dims):
    dims = [d % x.rank for d in dims]
    big = np.iinfo(np.int64).max
    return b.op("Slice", x, b.ints([-1] * len(dims)), b.ints([-big] * len(dims)), b.ints(dims), b.ints([-1] * len(dims)))


@emits(aten.constant_pad_nd.default)
def constant_pad(b, node, x, pad, value=0):
    """torch pads (last dim first, [begin, end] pairs) -> ONNX Pad; negative pads crop with a Slice
    whose ends count from the end of each axis, so symbolic sizes need no value."""
    begins, ends = [0] * x.rank, [0] * x.rank
    for k in range(len(pad) // 2):
        dim = x.rank - 1 - k
        begins[dim], ends[dim] = pad[2 * k], pad[2 * k + 1]
    crops = [d for d in range(x.rank) if min(begins[d], ends[d]) < 0]
    if crops:
        big = np.iinfo(np.int64).max
        starts = [max(0, -begins[d]) for d in crops]
        stops = [ends[d] if ends[d] < 0 else big for d in crops]
        x = b.op("Slice", x, b.ints(starts), b.ints(stops), b.ints(crops), dtype=x.dtype)
        begins, ends = [max(0, p) for p in begins], [max(0, p) for p in ends]
    if not any(begins + ends):
        return x
    return b.op("Pad", x, b.ints(begins + ends), b.scalar(value, x.dtype), mode="constant")


@emits(aten.repeat.default)
def repeat(b, node, x, repeats):
    extra = len(repeats) - x.rank
    if extra:
        x = b.reshape(x, [1] * extra + list(x.shape))
    return b.op("Tile", x, b.ints(repeats))


@emits(aten.tril.default, aten.triu.default)
def emit_trilu(b, node, x, diagonal=0):
    return b.op("Trilu", x, b.const(np.int64(diagonal)), upper=int(node.target is aten.triu.default))
