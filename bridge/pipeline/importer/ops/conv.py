"""Convolutions: Conv and ConvTranspose (1-D, 2-D, 3-D).

ONNX pads are per-side (``[x1_begin, x2_begin, ..., x1_end, x2_end, ...]``) or come from
``auto_pad``; torch pads symmetrically. The symmetric part goes to torch, the rest is an
explicit constant pad before the op (Conv) or a crop after it (ConvTranspose).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ....geometry import torch_pad
from ..registry import NodeContext, converter

# The functional convolutions, not ``torch.convolution``: they trace to the same ``aten.convolution``, and torch's
# autocast (mixed precision) casts their inputs, as it does for torch.nn's Conv modules.
_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TRANSPOSED_CONVS = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def spatial_attrs(ctx: NodeContext, rank: int) -> tuple[list[int], list[int]]:
    """(strides, dilations), one per spatial dim (ONNX defaults: 1)."""
    return list(ctx.attr("strides") or [1] * rank), list(ctx.attr("dilations") or [1] * rank)


def forward_pads(
    ctx: NodeContext, sizes: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(begins, ends) per spatial dim of a Conv or pooling node, resolving ``auto_pad``."""
    rank = len(sizes)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(sizes, kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total = max(0, (out - 1) * s + d * (k - 1) + 1 - size)
            small, large = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins, ends
    if auto_pad == "VALID":
        return [0] * rank, [0] * rank
    if auto_pad != "NOTSET":
        raise ctx.unsupported(f"auto_pad='{auto_pad}'")
    pads = list(ctx.attr("pads") or [0] * (2 * rank))
    return pads[:rank], pads[rank:]


def split_pads(
    x: torch.Tensor, begins: Sequence[int], ends: Sequence[int], value: float, limits: Sequence[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Pad ``x`` explicitly by what torch's symmetric ``padding`` cannot express.

    Returns the padded input and the symmetric padding for torch (at most ``limits``).
    """
    symmetric = [min(b, e) for b, e in zip(begins, ends, strict=True)]
    if limits is not None:
        symmetric = [m if m <= limit else 0 for m, limit in zip(symmetric, limits, strict=True)]
    extra_begin = [b - m for b, m in zip(begins, symmetric, strict=True)]
    extra_end = [e - m for e, m in zip(ends, symmetric, strict=True)]
    if any(extra_begin) or any(extra_end):
        x = F.pad(x, torch_pad(extra_begin, extra_end), value=value)
    return x, symmetric


@converter("Conv")
def conv(ctx, x, weight, bias=None):
    rank = weight.dim() - 2
    strides, dilations = spatial_attrs(ctx, rank)
    begins, ends = forward_pads(ctx, x.shape[2:], weight.shape[2:], strides, dilations)
    x, padding = split_pads(x, begins, ends, 0.0)
    return _CONVS[rank](x, weight, bias, strides, padding, dilations, ctx.attr("group", 1))


@converter("ConvTranspose")
def conv_transpose(ctx, x, weight, bias=None):
    """Full transposed convolution, then the ONNX pads (or output_shape) cropped off."""
    rank = weight.dim() - 2
    strides, dilations = spatial_attrs(ctx, rank)
    output_padding = list(ctx.attr("output_padding") or [0] * rank)
    sizes, kernel = list(x.shape[2:]), list(weight.shape[2:])
    full = [s * (i - 1) + op + d * (k - 1) + 1 for i, k, s, d, op in zip(sizes, kernel, strides, dilations, output_padding, strict=True)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    output_shape = ctx.attr("output_shape")
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ctx.unsupported(f"auto_pad='{auto_pad}'")
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        wanted = list(output_shape)[-rank:] if output_shape is not None else [i * s for i, s in zip(sizes, strides, strict=True)]
        totals = [f - w for f, w in zip(full, wanted, strict=True)]
        small = [t // 2 for t in totals]
        large = [t - t // 2 for t in totals]
        begins, ends = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        begins, ends = [0] * rank, [0] * rank
    else:
        pads = list(ctx.attr("pads") or [0] * (2 * rank))
        begins, ends = pads[:rank], pads[rank:]
    symmetric = [max(0, min(b, e)) for b, e in zip(begins, ends, strict=True)]
    y = _TRANSPOSED_CONVS[rank](x, weight, bias, strides, symmetric, output_padding, ctx.attr("group", 1), dilations)
    crop = torch_pad([m - b for b, m in zip(begins, symmetric, strict=True)], [m - e for e, m in zip(ends, symmetric, strict=True)])
    return F.pad(y, crop) if any(crop) else y
