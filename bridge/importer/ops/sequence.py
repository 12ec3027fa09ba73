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
    if ctx.attr("new_axis", 0):
        return torch.stack(sequence, dim=axis)
    return torch.cat(sequence, dim=axis)
