"""Shape and data-movement ops: Constant, Shape, Reshape, Transpose, Concat, Slice, Gather, ..."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ....contract import PADDING_IDX
from ....errors import InvalidModelError, ShapeError
from .. import padding
from ..registry import converter


@converter("Identity")
def convert_identity(ctx, x):
    """A tensor or a whole sequence (a list, returned as the node's one output)."""
    return (x,) if isinstance(x, list) else x


@converter("Constant")
def constant(ctx):
    for name, cast in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if ctx.has_attr(name):
            value = ctx.attr(name)
            return np.asarray(value) if cast is None else np.asarray(value, dtype=cast)
    raise ctx.unsupported("a Constant without value/value_float(s)/value_int(s)")


@converter("Shape")
def shape(ctx, x):
    symbolic = any(isinstance(d, torch.SymInt) for d in x.shape)
    dims = np.asarray(list(x.shape), dtype=object if symbolic else np.int64)
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    return dims[start:end]


@converter("Size")
def size(ctx, x):
    size = math.prod(x.shape)
    return np.asarray(size, dtype=object if isinstance(size, torch.SymInt) else np.int64)


def _reshape_target(ctx, x, shape: list[int]) -> list[int]:
    """ONNX Reshape semantics: 0 copies the input dim (unless allowzero), -1 is inferred."""
    if ctx.attr("allowzero", 0):
        return shape
    return [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]


@converter("Reshape", static=(1,))
def convert_reshape(ctx, x, shape):
    if ctx.opset < 5:
        shape = ctx.attr("shape")
    return x.reshape(_reshape_target(ctx, x, ctx.ints(shape)))


@converter("Flatten")
def flatten(ctx, x):
    """[d0 * ... * d(axis-1), d(axis) * ... * d(r-1)]; a negative axis counts from the rank r."""
    axis = ctx.attr("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


@converter("Transpose")
def convert_transpose(ctx, x):
    perm = ctx.attr("perm") or list(reversed(range(x.dim())))
    return x.permute(perm)


def _axes_attr_or_input(ctx, axes_input, since=13):
    if ctx.opset >= since:
        return None if axes_input is None else ctx.ints(axes_input)
    return ctx.attr("axes")


@converter("Squeeze", static=(1,))
def squeeze(ctx, x, axes=None):
    axes = _axes_attr_or_input(ctx, axes)
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    return x.reshape([d for i, d in enumerate(x.shape) if i not in {a % x.dim() for a in axes}])


@converter("Unsqueeze", static=(1,))
def unsqueeze(ctx, x, axes=None):
    axes = _axes_attr_or_input(ctx, axes)
    rank = x.dim() + len(axes)
    dims = list(x.shape)
    for axis in sorted(a % rank for a in axes):
        dims.insert(axis, 1)
    return x.reshape(dims)


@converter("Concat")
def concat(ctx, *xs):
    return torch.cat(xs, dim=ctx.attr("axis"))


@converter("Split", static=(1,))
def convert_split(ctx, x, sizes=None):
    axis = ctx.attr("axis", 0)
    if ctx.opset < 13:
        sizes = ctx.attr("split")
    elif sizes is not None:
        sizes = ctx.ints(sizes)
    parts = len(ctx.node.output)
    if sizes is None:
        length = x.shape[axis]
        chunk = ctx.attr("num_outputs") and -(-length // parts) or length // parts
        sizes = [min(chunk, length - i * chunk) for i in range(parts)]
    return torch.split(x, list(sizes), dim=axis)


@converter("Slice", static=(1, 2, 3, 4))
def convert_slice(ctx, x, starts=None, ends=None, axes=None, steps=None):
    """One ``aten.slice`` per sliced axis (a negative step: flip, then slice forward); axes kept
    whole trace nothing, so a symbolic batch axis is never compared with a number."""
    if ctx.opset < 10:
        starts, ends, axes = ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes")
    starts, ends = ctx.ints(starts), ctx.ints(ends)
    axes = ctx.ints(axes) if axes is not None else list(range(len(starts)))
    steps = ctx.ints(steps) if steps is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= x.dim()
        length = x.shape[axis]
        if _whole_axis(start, end, step, length):
            continue
        if step > 0:
            start = min(max(start + length if start < 0 else start, 0), length)
            end = min(max(end + length if end < 0 else end, 0), length)
            x = torch.ops.aten.slice(x, axis, start, max(end, start), step)
        else:
            start = min(max(start + length if start < 0 else start, -1), length - 1)
            end = min(max(end + length if end < 0 else end, -1), length - 1)
            first, last = length - 1 - start, length - 1 - end
            x = torch.ops.aten.slice(torch.flip(x, [axis]), axis, first, max(last, first), -step)
    return x


def _whole_axis(start: int, end: int, step: int, length) -> bool:
    """True when a Slice keeps the whole axis (no op is traced then). A symbolic length (the batch)
    is never compared with a number, which would fix it: only ``0:<int32 max or more>`` qualifies."""
    if step != 1:
        return False
    if isinstance(length, torch.SymInt):
        return start == 0 and end >= 2**31 - 1
    if isinstance(end, torch.SymInt):  # a symbolic end (a sequence length) on a static axis: no guard on it
        return start == 0 and statically_known_true(end >= length)
    return (start == 0 or start <= -length) and end >= length


@converter("Gather")
def convert_gather(ctx, x, indices):
    """``x`` indexed along ``axis``; with ``bridge.padding_idx`` (contract ``PADDING_IDX``) an embedding
    lookup whose padding row gets no gradient, as torch's ``nn.Embedding(padding_idx=...)``."""
    axis = ctx.attr("axis", 0) % x.dim()
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    row = _padding_row(ctx, x)
    if row is not None:
        return F.embedding(indices, x, padding_idx=row)
    flat = x.index_select(axis, indices.reshape(-1))
    return flat.reshape(list(x.shape[:axis]) + list(indices.shape) + list(x.shape[axis + 1:]))


def _padding_row(ctx, table) -> int | None:
    """The node's ``bridge.padding_idx`` (None without one), checked: a Gather along axis 0 of a 2-D table,
    an integer row of it."""
    text = next((p.value for p in ctx.node.metadata_props if p.key == PADDING_IDX), None)
    if text is None:
        return None
    rows = table.shape[0] if table.dim() == 2 else None
    try:
        row = int(text)
    except ValueError:
        row = None
    if ctx.attr("axis", 0) % table.dim() != 0 or rows is None or row is None or not -rows <= row < rows:
        raise InvalidModelError(
            f"Gather node '{ctx.name}': {PADDING_IDX}={text!r} needs a Gather along axis 0 of a 2-D table and a "
            f"row of it (the table is {list(table.shape)}, the axis {ctx.attr('axis', 0)}); fix or remove the "
            "metadata")
    return row % rows


@converter("GatherElements")
def gather_elements(ctx, x, indices):
    axis = ctx.attr("axis", 0) % x.dim()
    indices = torch.where(indices < 0, indices + x.shape[axis], indices)
    return torch.gather(x, axis, indices)


@converter("Expand", static=(1,))
def convert_expand(ctx, x, shape):
    shape = ctx.ints(shape)
    rank = max(len(shape), x.dim())
    shape = [1] * (rank - len(shape)) + shape
    dims = [1] * (rank - x.dim()) + list(x.shape)
    target = [d if s == 1 else s for s, d in zip(shape, dims, strict=True)]
    return x.reshape(dims).expand(target)


@converter("Tile", static=(1,))
def tile(ctx, x, repeats):
    return x.repeat(ctx.ints(repeats))


@converter("ConstantOfShape", static=(0,))
def constant_of_shape(ctx, shape):
    value = ctx.attr("value")
    value = np.zeros(1, dtype=np.float32) if value is None else value.reshape(-1)
    sizes = ctx.ints(shape)
    if any(isinstance(d, torch.SymInt) for d in sizes):
        return torch.full(sizes, value[0].item(), dtype=torch.from_numpy(value).dtype)
    return np.full(sizes, value[0], dtype=value.dtype)


@converter("Range", static=(0, 1, 2))
def range_(ctx, start, limit, delta):
    bounds = [np.asarray(v).reshape(-1)[0] for v in (start, limit, delta)]
    if any(isinstance(v, torch.SymInt) for v in bounds):
        return torch.arange(*bounds, dtype=torch.int64)
    return np.arange(*[v.item() for v in bounds], dtype=np.asarray(start).dtype)


@converter("Pad", static=(1, 2, 3))
def pad(ctx, x, pads=None, value=None, axes=None):
    """constant mode with ``F.pad``; reflect / edge / wrap axis by axis with Slice + Concat forms
    (``bridge.pipeline.importer.padding``), whose forward and backward export to ops onnx-mlir accepts."""
    if ctx.opset < 11:
        pads, value = ctx.attr("pads"), ctx.attr("value", 0.0)
    pads = ctx.ints(pads)
    rank = x.dim()
    axes = [a % rank for a in ctx.ints(axes)] if axes is not None else list(range(rank))
    half = len(pads) // 2
    begins, ends = [0] * rank, [0] * rank
    for k, axis in enumerate(axes):
        begins[axis], ends[axis] = pads[k], pads[k + half]
    mode = ctx.attr("mode", "constant")
    if mode == "constant":
        fill = float(np.asarray(value).reshape(-1)[0]) if value is not None and np.asarray(value).size else 0.0
        torch_pads = [p for axis in reversed(range(rank)) for p in (begins[axis], ends[axis])]
        return F.pad(x, torch_pads, value=fill)
    if mode not in ("reflect", "edge", "wrap"):
        raise ctx.unsupported(f"mode={mode!r}")
    for axis in range(rank):
        if begins[axis] or ends[axis]:
            _check_pad_fits(ctx, x, axis, begins[axis], ends[axis], mode)
            x = padding.pad_axis(x, axis, begins[axis], ends[axis], mode)
    return x


def _check_pad_fits(ctx, x, axis: int, begin: int, end: int, mode: str) -> None:
    """Crops leave a non-empty axis; reflect pads at most length - 1 elements per side, edge and
    wrap need at least one element."""
    length = x.shape[axis] + min(begin, 0) + min(end, 0)
    limit = length - 1 if mode == "reflect" else (None if length > 0 else 0)
    if length <= 0 or (limit is not None and max(begin, end) > limit):
        raise ShapeError(
            f"Pad node '{ctx.name}': mode={mode} pads axis {axis} of length {length} by ({begin}, {end}); "
            f"at most {limit} per side is possible (as in onnxruntime and torch)"
        )


@converter("Trilu", static=(1,))
def convert_trilu(ctx, x, k=None):
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return torch.triu(x, k) if ctx.attr("upper", 1) else torch.tril(x, k)


@converter("OneHot", static=(1, 2))
def one_hot(ctx, indices, depth, values):
    depth = int(np.asarray(depth).reshape(-1)[0])
    off, on = (torch.as_tensor(v) for v in np.asarray(values).reshape(-1))
    axis = ctx.attr("axis", -1)
    indices = torch.where(indices < 0, indices + depth, indices)
    hot = indices.unsqueeze(-1) == torch.arange(depth)
    out = torch.where(hot, on, off)
    return out.movedim(-1, axis) if axis != -1 else out


@converter("DepthToSpace")
def depth_to_space(ctx, x):
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    if ctx.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@converter("SpaceToDepth")
def space_to_depth(ctx, x):
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)

