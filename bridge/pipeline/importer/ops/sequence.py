"""Sequence ops as Python lists of tensors: SplitToSequence, SequenceAt, SequenceConstruct,
SequenceLength, ConcatFromSequence (what the dynamo exporter emits for ``torch.split`` and
``torch.cat`` of a split when its optimizer is off). A sequence is one value of the graph."""
from __future__ import annotations

import numpy as np
import torch

from ..registry import converter


@converter("SplitToSequence", static=(1,))
def split_to_sequence(ctx, x, split=None):
    axis = ctx.attr("axis", 0) % x.dim()
    if split is None:
        parts = list(torch.split(x, 1, dim=axis))
        if not ctx.attr("keepdims", 1):
            parts = [p.squeeze(axis) for p in parts]
        return (parts,)
    sizes = ctx.ints(split)
    return (list(torch.split(x, sizes[0] if np.ndim(split) == 0 else sizes, dim=axis)),)


@converter("SequenceAt", static=(1,))
def sequence_at(ctx, sequence, position):
    return sequence[int(np.asarray(position).reshape(-1)[0])]


@converter("SequenceConstruct")
def sequence_construct(ctx, *xs):
    return (list(xs),)


@converter("SequenceLength")
def sequence_length(ctx, sequence):
    return np.asarray(len(sequence), dtype=np.int64)


@converter("ConcatFromSequence")
def concat_from_sequence(ctx, sequence):
    axis = ctx.attr("axis")
    # elements known before the model runs (a folded constant inserted into the list) are numpy
    sequence = [torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for v in sequence]
    if ctx.attr("new_axis", 0):
        return torch.stack(sequence, dim=axis)
    return torch.cat(sequence, dim=axis)


def _position(sequence: list, position, insert: bool = False) -> int:
    """A SequenceInsert/SequenceErase position (negative counts from the end) as a list index."""
    if position is None:
        return len(sequence) if insert else len(sequence) - 1
    index = int(np.asarray(position).reshape(-1)[0])
    return index + len(sequence) if index < 0 else index


@converter("SequenceInsert", static=(2,))
def sequence_insert(ctx, sequence, tensor, position=None):
    """A new list: ``sequence`` with ``tensor`` inserted at ``position`` (default: appended)."""
    result = list(sequence)
    result.insert(_position(sequence, position, insert=True), tensor)
    return (result,)


@converter("SequenceErase", static=(1,))
def sequence_erase(ctx, sequence, position=None):
    """A new list: ``sequence`` without the element at ``position`` (default: the last)."""
    result = list(sequence)
    del result[_position(sequence, position)]
    return (result,)


@converter("SequenceEmpty")
def sequence_empty(ctx):
    """An empty list (its ``dtype`` matters only once elements are inserted, which carry theirs)."""
    return ([],)
