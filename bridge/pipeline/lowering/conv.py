"""Convolution backward (and transposed convolution) written with stride-1 and strided ``Conv``;
a Conv's forward on a tiny output plane as one MatMul.

onnx-mlir compiles ``ConvTranspose`` only with a constant weight, so no gradient and no
trainable transposed layer may use it. Everything here is ``aten.convolution`` (non
transposed), ``mm``, ``constant_pad_nd`` (negative pads crop), strided slices, ``cat``,
reshape/permute, ``add`` and ``flip``. Which form a shape gets is the current target's choice
(bridge/pipeline/targets.py: ``conv_*_form``); the plain graph uses the ``conv`` forms only.

* ``input_grad`` (the transposed convolution):
  - ``conv``: zero-insert ``grad_output`` by the stride (``zero_insert``), pad it so that a stride-1
    Conv with the spatially flipped, in/out-swapped weight (per group) and the forward dilation
    lands exactly on the input positions, padding with zeros where the forward output floored.
  - ``gemm`` (groups 1): the columns ``weight^T [K*Cin, Cout] @ grad_output [Cout, N*O]`` (one Gemm
    reading the weight transposed), one ``[Cin, N, O]`` part per kernel offset, added back onto the
    input positions by ``scatter_windows`` (col2im, batch and channel swapped), then one Transpose.
  - ``gemm_offsets`` (groups 1): ``gemm`` with one Gemm ``[Cin, N*O]`` per kernel offset, each made where it is
    added back: a ``K``-th of the columns alive at a time.
  - ``gemm_select`` (groups 1): the columns ``grad_output^T @ weight`` as ``[N*Cin, O*K]``, col2im as
    one MatMul with a constant 0/1 ``[O*K, L]`` (``scatter_matrix``).
* ``weight_grad``:
  - ``conv``: a Conv whose batch and channel roles are swapped: the input, as
    ``[Cin/g, g*N, L]``, is convolved with ``grad_output`` as a weight ``[g*Cout/g, N, O]``
    (groups ``g``, stride = forward dilation, dilation = forward stride), then sliced to the
    kernel size (a GEMM whose inner dimension is the batch).
  - ``gemm`` (groups 1, im2col): the input channels-last, one strided slice per kernel offset
    (``window_slices``) stacked channel-major into columns ``[N*O, Cin*K]``, one MatMul
    ``grad_output [Cout, N*O] @ columns``: the weight's layout.
  - ``gemm_channel_first`` (groups 1): the windows of the batch-transposed input ``[Cin, N, L...]``
    stacked channel-major into columns ``[Cin*K, N*O]``, one Gemm ``grad_output @ columns^T``.
  - ``gather`` (groups 1): the padded channels-last input ``[N, Lp, Cin]`` gathered at every window's
    offsets into columns ``[N*O, K*Cin]`` (one Gather copying whole ``Cin`` rows), one MatMul, the
    weight-sized product transposed to the weight's layout. Also where ``gemm``'s columns would be the
    forward product's own (``_forward_rows``): built apart, they need not stay alive from the forward.
  - ``gather_offsets`` (groups 1): ``gather`` with one Gather ``[N*O, Cin]`` and one MatMul per kernel
    offset, the ``[Cout, Cin]`` products concatenated: a ``K``-th of the columns alive at a time.
  - ``gather_parts`` (groups 1): ``gather`` with one Gather and one MatMul per group of kernel offsets, as many
    groups as ``targets.column_parts`` says.
* ``grad_bias``: a sum over batch and spatial dims.
* the forward: an ONNX ``Conv``, or ``gemm`` (groups 1): the weight as it is, ``[Cout, Cin*K]``, times the
  input's columns ``[Cin*K, N*O]``, or (``targets.conv_forward_product``) the channels-last columns
  ``[N*O, Cin*K]`` times the weight transposed; those gathered and multiplied per range of output positions
  where ``targets.column_parts`` cuts them.

A Gemm reads a transposed operand as it is (``transA``/``transB``), so ``grad_output`` is only
ever transposed batch for channel (whole planes move), never to channels-last.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from ...dtypes import TORCH_TO_NUMPY
from ...geometry import per_dim, pooled_size, torch_pad
from .. import targets
from . import lowers

aten = torch.ops.aten


def _spatial(x: torch.Tensor, channels_last: bool = False) -> list[int]:
    return list(x.shape[1:-1]) if channels_last else list(x.shape[2:])


def fit_spatial(x: torch.Tensor, sizes: Sequence[int], channels_last: bool = False) -> torch.Tensor:
    """Crop (or zero-pad) the end of each spatial dim of ``x`` (``[N, C, L...]``, or ``[N, L..., C]``
    when ``channels_last``) to ``sizes``."""
    have = _spatial(x, channels_last)
    if have == list(sizes):
        return x
    return _pad_spatial(x, [0] * len(have), [s - h for s, h in zip(sizes, have, strict=True)], channels_last)


def _pad_spatial(x: torch.Tensor, begins: Sequence[int], ends: Sequence[int], channels_last: bool) -> torch.Tensor:
    """Zero-pad (negative: crop) the spatial dims of ``x``."""
    return aten.constant_pad_nd.default(x, [0, 0] * channels_last + torch_pad(begins, ends), 0.0)


def _pad_to_windows(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                    dilation: Sequence[int], outputs: Sequence[int], fill: float = 0.0, first: int = 2) -> torch.Tensor:
    """``x`` padded with ``fill`` (begin ``padding``; end cropped or padded to exactly what the windows read):
    window ``o``'s offset ``j`` is then at ``o*s + j*d`` of each spatial dim (``first ..``). ``x`` itself where
    the windows read exactly ``x`` (no op traced: the exporter emits nothing for a zero pad)."""
    rank = len(kernel)
    pad = [0, 0] * (x.dim() - first - rank)
    for size, o, k, s, p, d in reversed(list(zip(x.shape[first:first + rank], outputs, kernel, stride, padding,
                                                  dilation, strict=True))):
        pad += [p, (o - 1) * s + d * (k - 1) + 1 - size - p]
    return x if all(_is_zero(p) for p in pad) else aten.constant_pad_nd.default(x, pad, fill)


def _is_zero(size) -> bool:
    """A size that is 0 as a plain int (a symbolic one is never compared: that would guard on it)."""
    return type(size) is int and size == 0


def window_slices(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int], outputs: Sequence[int], fill: float = 0.0, first: int = 2
                  ) -> list[torch.Tensor]:
    """One tensor per kernel offset (row-major): the element each window holds there, i.e. strided
    slices of ``x`` padded with ``fill`` (begin ``padding``, end to exactly what the windows
    read). The spatial dims of ``x`` are ``first .. first + len(kernel) - 1``; a slice of a whole dim is not
    traced (the exporter emits nothing for it)."""
    padded = _pad_to_windows(x, kernel, stride, padding, dilation, outputs, fill, first)
    windows = []
    for offset in itertools.product(*[range(k) for k in kernel]):
        window = padded
        for axis, (j, o, s, d) in enumerate(zip(offset, outputs, stride, dilation, strict=True)):
            if not (_is_zero(j * d) and s == 1 and _is_zero((o - 1) * s + 1 - window.shape[first + axis])):
                window = aten.slice.Tensor(window, first + axis, j * d, j * d + (o - 1) * s + 1, s)
        windows.append(window)
    return windows


def scatter_windows(parts: Iterable[torch.Tensor], sizes: Sequence[int], kernel: Sequence[int],
                    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                    channels_last: bool = False) -> torch.Tensor:
    """The adjoint of ``window_slices`` (col2im): part ``j`` ``[N, C, O...]`` (kernel offset ``j``;
    ``[N, O..., C]`` when ``channels_last``) added onto ``[N, C, sizes...]`` (``[N, sizes..., C]``),
    output ``o`` of offset ``j`` at ``o*s + j*d - p``. ``parts`` is consumed in offset order, one part at a
    time: given as a generator, each part is traced just before it is added, so that the graph order (in which
    onnx-mlir allocates and frees) keeps one part alive at a time instead of all of them.

    Offsets that land on the same stride phase ``(j*d - p) mod s`` are shifted and added on the
    small output grid; the phases are then interleaved when all are there on one grid, else each
    is spread once at its phase: at most ``s**rank`` spreads of the input size instead of one per
    offset (or a Conv over a zero-inserted stack).
    """
    remaining = iter(parts)
    first = next(remaining)
    outputs = _spatial(first, channels_last)
    phases: dict[tuple[int, ...], torch.Tensor] = {}
    for offset, part in zip(itertools.product(*[range(k) for k in kernel]), itertools.chain([first], remaining),
                            strict=True):
        shifts = [j * d - p for j, d, p in zip(offset, dilation, padding, strict=True)]
        phase = tuple(shift % s for shift, s in zip(shifts, stride, strict=True))
        grid = [-(-(size - r) // s) for size, r, s in zip(sizes, phase, stride, strict=True)]  # positions m*s + r < size
        begins = [shift // s for shift, s in zip(shifts, stride, strict=True)]
        if any(m <= 0 or b >= m or b + o <= 0 for b, o, m in zip(begins, outputs, grid, strict=True)):
            continue  # this offset reads padding only or its phase holds no position (an empty Slice is what IREE rejects)
        placed = _pad_spatial(part, begins, [m - o - b for m, o, b in zip(grid, outputs, begins, strict=True)], channels_last)
        phases[phase] = placed if phase not in phases else aten.add.Tensor(phases[phase], placed)
    if len(phases) == math.prod(stride) > 1 and len({tuple(_spatial(p, channels_last)) for p in phases.values()}) == 1:
        return fit_spatial(_interleave(phases, stride, channels_last), sizes, channels_last)
    total = None
    for phase, summed in phases.items():
        spread = fit_spatial(zero_insert(summed, stride, phase, channels_last), sizes, channels_last)
        total = spread if total is None else aten.add.Tensor(total, spread)
    if total is None:  # every window reads padding only
        n, c = first.shape[0], first.shape[-1 if channels_last else 1]
        return aten.new_zeros.default(first, [n] + list(sizes) + [c] if channels_last else [n, c] + list(sizes))
    return total


def _interleave(phases: dict[tuple[int, ...], torch.Tensor], stride: Sequence[int], channels_last: bool = False
                ) -> torch.Tensor:
    """Every stride phase, each ``[N, C, M...]`` (or ``[N, M..., C]``), as one ``[N, C, M*s...]``
    (``[N, M*s..., C]``), element ``m`` of phase ``r`` at ``m*s + r``: one Concat and one Transpose
    instead of a spread and an Add per phase. With ``constant_matmul_moves`` (targets.py), channels
    first, the last dim by ``_interleave_last`` first, so that the Transpose's innermost block is a row."""
    rank = len(stride)
    if stride[-1] > 1 and not channels_last and targets.enabled("constant_matmul_moves"):
        phases = {prefix + (0,): _interleave_last([phases[prefix + (r,)] for r in range(stride[-1])])
                  for prefix in itertools.product(*[range(s) for s in stride[:-1]])}
        stride = list(stride[:-1]) + [1]
    order = list(itertools.product(*[range(s) for s in stride]))
    first = phases[order[0]]
    if len(order) == 1:
        return first
    grid = _spatial(first, channels_last)
    lead, trail = ([-1], [first.shape[-1]]) if channels_last else ([-1, first.shape[1]], [])
    strided = [i for i in range(rank) if stride[i] > 1]  # a size-1 axis would make the Transpose element-wise
    at = len(strided) + len(lead)  # the first grid axis of the stack
    stacked = aten.cat.default([aten.unsqueeze.default(phases[r], 0) for r in order], 0)
    stacked = aten.reshape.default(stacked, [stride[i] for i in strided] + lead + grid + trail)
    perm = list(range(len(strided), at))
    for i in range(rank):
        perm += [at + i] + ([strided.index(i)] if i in strided else [])
    perm += list(range(at + rank, at + rank + len(trail)))
    return aten.reshape.default(aten.permute.default(stacked, perm), lead + [m * s for m, s in zip(grid, stride, strict=True)] + trail)


def _interleave_last(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``s`` tensors ``[..., M]`` as one ``[..., M*s]``, element ``m`` of part ``r`` at ``m*s + r``:
    a Concat and one MatMul with a constant ``[s*M, M*s]`` permutation. Exact for finite values; an
    infinity makes its row NaN."""
    size, count = parts[0].shape[-1], len(parts)
    matrix = np.concatenate([_spread_matrix(size, count, r) for r in range(count)])
    return _times(aten.cat.default(list(parts), -1) if count > 1 else parts[0], matrix)


def _spread_matrix(size: int, stride: int, phase: int) -> np.ndarray:
    """``[O, O*s]``: 1 at ``[o, o*s + phase]``, else 0."""
    matrix = np.zeros((size, size * stride))
    matrix[np.arange(size), np.arange(size) * stride + phase] = 1.0
    return matrix


def _times(x: torch.Tensor, matrix: np.ndarray) -> torch.Tensor:
    """``x [..., A] @ matrix [A, B]`` (a constant) as ``[..., B]``, through one 2-D MatMul."""
    rows = aten.reshape.default(x, [-1, matrix.shape[0]])
    return aten.reshape.default(aten.mm.default(rows, constant(matrix, x)), list(x.shape[:-1]) + [matrix.shape[1]])


def zero_insert(x: torch.Tensor, stride: Sequence[int], phase: Sequence[int] | None = None,
                channels_last: bool = False) -> torch.Tensor:
    """Spread each spatial element over ``stride`` positions, zeros around it: ``[N, C, O]`` ->
    ``[N, C, O * s]`` (or ``[N, O, C]`` -> ``[N, O * s, C]``), element ``o`` at ``o * s + phase``
    (default phase 0: zeros after it).

    Each strided dim by a reshape and a Pad; with ``constant_matmul_moves`` (targets.py), channels
    first, the last dim by a MatMul with a constant 0/1 ``[O, O*s]`` instead (``_interleave_last``'s
    caveat: an infinity makes its row NaN), so that each Pad's innermost block is a row."""
    phase = list(phase or [0] * len(stride))
    stride = list(stride)
    if stride[-1] > 1 and not channels_last and targets.enabled("constant_matmul_moves"):
        x, stride[-1] = _times(x, _spread_matrix(x.shape[-1], stride[-1], phase[-1])), 1
    if all(s == 1 for s in stride):
        return x
    sizes = _spatial(x, channels_last)
    lead, trail = ([x.shape[0]], [x.shape[-1]]) if channels_last else ([x.shape[0], x.shape[1]], [])
    interleaved, pad = list(lead), [0, 0] * len(trail)
    for size, s in zip(sizes, stride, strict=True):
        interleaved += [size, 1] if s > 1 else [size]
    for s, r in reversed(list(zip(stride, phase, strict=True))):
        pad += [r, s - 1 - r, 0, 0] if s > 1 else [0, 0]
    y = aten.constant_pad_nd.default(aten.reshape.default(x, interleaved + trail), pad, 0.0)
    return aten.reshape.default(y, lead + [size * s for size, s in zip(sizes, stride, strict=True)] + trail)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """``[N, C, L...]`` -> ``[N, L..., C]``."""
    return aten.permute.default(x, [0] + list(range(2, x.dim())) + [1])


def _channel_rows(x: torch.Tensor) -> torch.Tensor:
    """``[N, C, L...]`` -> ``[C, N*L]``."""
    return aten.reshape.default(aten.permute.default(x, [1, 0] + list(range(2, x.dim()))), [x.shape[1], -1])


def _swapped_flipped_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``[g*Co, Ci, k...]`` -> ``[g*Ci, Co, k...]`` flipped spatially (the transposed kernel).

    The flip is a ``flip`` (a Slice with negative steps) or, with ``constant_matmul_moves`` (targets.py),
    a MatMul of the flattened kernel with the constant ``[K, K]`` reversal (an infinity makes its row NaN).
    The swap is one Transpose of the weight (``g == 1`` without that MatMul), else a Transpose whose
    innermost block is the flattened kernel, between Reshapes (no size-1 group axis when ``g == 1``)."""
    out_channels, in_per_group, kernel = weight.shape[0], weight.shape[1], list(weight.shape[2:])
    per_group, count = out_channels // groups, math.prod(kernel)
    spatial = list(range(2, 2 + len(kernel)))
    if groups == 1 and (count == 1 or not targets.enabled("constant_matmul_moves")):
        w = aten.permute.default(weight, [1, 0] + spatial)  # one Transpose: no reshapes around it
        return w if count == 1 else aten.flip.default(w, spatial)
    if groups == 1:
        w = aten.permute.default(aten.reshape.default(weight, [out_channels, in_per_group, count]), [1, 0, 2])
    else:
        w = aten.reshape.default(weight, [groups, per_group, in_per_group, count])
        w = aten.permute.default(w, [0, 2, 1, 3])
    if count == 1:
        return aten.reshape.default(w, [groups * in_per_group, per_group] + kernel)
    if targets.enabled("constant_matmul_moves"):
        return aten.reshape.default(_times(w, np.eye(count)[::-1]), [groups * in_per_group, per_group] + kernel)
    w = aten.reshape.default(w, [groups * in_per_group, per_group] + kernel)
    return aten.flip.default(w, spatial)


def input_grad(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    form: str | None = None,
) -> torch.Tensor:
    """d(conv(x, weight))/dx applied to ``grad_output``; ``input_size`` is x's spatial size.
    ``form`` (default: the current target's, ``targets.conv_input_grad_form``) is ``conv``, ``gemm``,
    ``gemm_offsets`` or ``gemm_select`` (module docstring)."""
    in_channels, out_channels, kernel, outputs = weight.shape[1], weight.shape[0], list(weight.shape[2:]), _spatial(grad_output)
    form = form or targets.conv_input_grad_form(in_channels, out_channels, groups, kernel, outputs, stride, input_size)
    if form in ("gemm", "gemm_offsets"):
        return _input_grad_gemm(grad_output, weight, input_size, stride, padding, dilation, form == "gemm_offsets")
    if form == "gemm_select":
        return _input_grad_select(grad_output, weight, input_size, stride, padding, dilation)
    return _input_grad_conv(grad_output, weight, input_size, stride, padding, dilation, groups)


def _input_grad_conv(grad_output, weight, input_size, stride, padding, dilation, groups) -> torch.Tensor:
    """A stride-1 Conv of the zero-inserted ``grad_output`` with the flipped, swapped weight.

    The gradient of input position ``j`` sits at position ``j + p`` of the "full" transposed
    result, whose first element needs a ``d*(k-1)`` zero border before the zero-inserted
    ``grad_output``; hence begin pad ``d*(k-1) - p`` and an end pad that yields exactly
    ``input_size`` positions (zeros past the last window when the forward output floored,
    cropping windows that reach past the padded input, as ceil_mode pooling does).
    """
    kernel = list(weight.shape[2:])
    outputs = _spatial(grad_output)
    spread = zero_insert(grad_output, stride)
    begins, ends = [], []
    for o, k, s, p, d, size in zip(outputs, kernel, stride, padding, dilation, input_size, strict=True):
        begin = d * (k - 1) - p
        begins.append(begin)
        ends.append(size + d * (k - 1) - begin - o * s)  # o * s: the spread length (trailing zeros included)
    conv_padding = [0] * len(kernel)
    if all(b == e and b >= 0 for b, e in zip(begins, ends, strict=True)):
        conv_padding, begins, ends = begins, [0] * len(kernel), [0] * len(kernel)
    if any(begins) or any(ends):
        spread = aten.constant_pad_nd.default(spread, torch_pad(begins, ends), 0.0)
    w = _swapped_flipped_weight(weight, groups)
    ones = [1] * len(kernel)
    return aten.convolution.default(spread, w, None, ones, conv_padding, list(dilation), False, [0] * len(kernel), groups)


def _input_grad_gemm(grad_output, weight, input_size, stride, padding, dilation, per_offset: bool = False
                     ) -> torch.Tensor:
    """col2im (groups 1): columns ``weight^T [K*Cin, Cout] @ grad_output [Cout, N*O]`` (the weight
    offset-major; one Gemm, ``transA``), scattered back per offset. ``per_offset``: one Gemm ``[Cin, N*O]`` per
    kernel offset, each made just before it is added back: a ``K``-th of the columns alive at a time.

    Offset-major, channel-before-batch columns make each offset's part ``[Cin, N, O...]`` a
    contiguous slice, and the scatter runs with batch and channel roles swapped; then one
    Transpose of input size (no multi-axis Transpose of the columns or the weight). Channel-major
    columns ``[Cin, K, N, O...]`` sliced along axis 1 are miscompiled by IREE at a symbolic batch
    (tests/test_conv.py, WideCNN); this form is not.
    """
    rank, out_channels, in_channels = weight.dim() - 2, weight.shape[0], weight.shape[1]
    kernel, outputs = list(weight.shape[2:]), _spatial(grad_output)
    count = math.prod(kernel)
    w = aten.permute.default(aten.reshape.default(weight, [out_channels, in_channels, count]), [0, 2, 1])  # [Cout, K, Cin]

    def offset_parts() -> Iterator[torch.Tensor]:  # each group's columns made where its first offset is added
        rows = None
        for group in _offset_groups(count, count if per_offset else 1):
            wg = w if len(group) == count else aten.slice.Tensor(w, 1, group.start, group.stop)
            wt = aten.t.default(aten.reshape.default(wg, [out_channels, len(group) * in_channels]))
            rows = _channel_rows(grad_output) if rows is None else rows  # [Cout, N*O]
            cols = aten.mm.default(wt, rows)  # a Gemm (transA): [K_g*Cin, N*O]
            cols = aten.reshape.default(cols, [len(group), in_channels, -1] + outputs)  # [K_g, Cin, N, O...]
            yield from (aten.select.int(cols, 0, j) for j in range(len(group)))

    swapped = scatter_windows(offset_parts(), input_size, kernel, stride, padding, dilation)  # [Cin, N, L...]
    return aten.permute.default(swapped, [1, 0] + list(range(2, 2 + rank)))


def _offset_groups(count: int, parts: int) -> list[range]:
    """The kernel offsets ``0 .. count - 1`` in ``min(parts, count)`` runs of consecutive offsets, as even as can be."""
    return [range(int(group[0]), int(group[-1]) + 1) for group in np.array_split(np.arange(count), min(parts, count))]


def _weight_rows(weight: torch.Tensor) -> torch.Tensor:
    """A Conv weight as ``[Cout, Cin*K]``, one view with the same arguments wherever a form reads it so (a forward
    and a backward product of one Conv then share it: common subexpression elimination merges equal views)."""
    return aten.reshape.default(weight, [weight.shape[0], math.prod(weight.shape[1:])])


def _input_grad_select(grad_output, weight, input_size, stride, padding, dilation) -> torch.Tensor:
    """col2im as one MatMul (groups 1): the columns ``grad_output^T [N*O, Cout] @ weight [Cout, Cin*K]``
    (the weight as it is), as ``[N*Cin, O*K]``, times the constant ``[O*K, L]`` of
    ``scatter_matrix``: no per-offset Slice, Pad and Add and no weight-sized Transpose. Where that matrix is the
    identity (a 1x1 kernel, stride 1, no padding) the columns are the gradient as they are: no MatMul. On a
    one-position output plane ``grad_output`` is already channels-last in memory: no Transpose."""
    n, out_channels, in_channels = grad_output.shape[0], weight.shape[0], weight.shape[1]
    kernel, outputs = list(weight.shape[2:]), _spatial(grad_output)
    positions, count = math.prod(outputs), math.prod(kernel)
    rows = aten.reshape.default(grad_output if positions == 1 else to_channels_last(grad_output), [-1, out_channels])
    cols = aten.mm.default(rows, _weight_rows(weight))  # [N*O, Cin*K]
    cols = aten.permute.default(aten.reshape.default(cols, [n, positions, in_channels, count]), [0, 2, 1, 3])
    cols = aten.reshape.default(cols, [-1, positions * count])  # [N*Cin, O*K]
    select = scatter_matrix(input_size, kernel, stride, padding, dilation, outputs)
    if select.shape[0] != select.shape[1] or select.sum() != len(select) or not select.diagonal().all():  # 0/1 entries
        cols = aten.mm.default(cols, constant(select, weight))
    return aten.reshape.default(cols, [n, in_channels] + list(input_size))


def constant(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A numpy array as a constant tensor of ``like``'s dtype: a float32 or float64 one converted before the trace
    sees it (no Cast node in the graph; numpy rounds float64 to float32 as a Cast does, to nearest even)."""
    if like.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.ascontiguousarray(array, dtype=TORCH_TO_NUMPY[like.dtype]))
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.dtype)


def scatter_matrix(sizes: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                   dilation: Sequence[int], outputs: Sequence[int]) -> np.ndarray:
    """``[O*K, L]`` (output position major, kernel offset minor): 1 where output ``o``'s window
    reads input position ``l`` at offset ``k`` (``l = o*s + k*d - p``), else 0 (offsets reading
    padding have no 1). Columns ``[.., O*K]`` times it are col2im."""
    matrix = np.zeros((math.prod(outputs), math.prod(kernel), math.prod(sizes)))
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    for i, o in enumerate(itertools.product(*[range(n) for n in outputs])):
        for j, k in enumerate(itertools.product(*[range(n) for n in kernel])):
            at = [oo * s + kk * d - p for oo, kk, s, d, p in zip(o, k, stride, dilation, padding, strict=True)]
            if all(0 <= a < n for a, n in zip(at, sizes, strict=True)):
                matrix[i, j, sum(a * st for a, st in zip(at, strides, strict=True))] = 1.0
    return matrix.reshape(-1, math.prod(sizes))


def weight_grad(grad_output: torch.Tensor, x: torch.Tensor, weight_size: Sequence[int], stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], groups: int, form: str | None = None,
                forward_product: str | None = None) -> torch.Tensor:
    """d(conv(x, w))/dw applied to ``grad_output``; ``form`` (default: the current target's,
    ``targets.conv_weight_grad_form``, told the Conv's ``forward_product`` if it has a forward) is ``conv``,
    ``gather``, ``gather_offsets``, ``gather_parts``, ``gemm`` or ``gemm_channel_first`` (see the module docstring)."""
    kernel, in_channels, out_channels, outputs = list(weight_size[2:]), x.shape[1], grad_output.shape[1], _spatial(grad_output)
    form = form or targets.conv_weight_grad_form(in_channels, out_channels, groups, kernel, outputs, stride, _spatial(x),
                                                 forward_product)
    if form == "conv":
        return _weight_grad_conv(grad_output, x, weight_size, stride, padding, dilation, groups)
    if form == "gemm_channel_first":
        return _weight_grad_gemm_channel_first(grad_output, x, weight_size, stride, padding, dilation)
    if form in ("gather", "gather_offsets", "gather_parts"):
        if form == "gather_parts":
            parts = targets.column_parts(in_channels, out_channels, kernel, outputs, _spatial(x))
        else:
            parts = 1 if form == "gather" else math.prod(kernel)
        return _weight_grad_gather(grad_output, x, weight_size, stride, padding, dilation, parts)
    return _weight_grad_gemm(grad_output, x, weight_size, stride, padding, dilation)


def _weight_grad_conv(grad_output, x, weight_size, stride, padding, dilation, groups) -> torch.Tensor:
    """A Conv over the batch, per group (batch and channel roles swapped)."""
    n, in_channels, sizes = x.shape[0], x.shape[1], _spatial(x)
    out_channels, outputs = grad_output.shape[1], _spatial(grad_output)
    in_per_group, out_per_group = in_channels // groups, out_channels // groups
    rank = len(sizes)
    spatial = list(range(3, 3 + rank))
    if groups == 1:  # no unit group axis: onnx-mlir miscomputes a MatMul of Reshape(Transpose(Reshape(x)))
        xs = aten.permute.default(x, [1, 0] + list(range(2, 2 + rank)))  # moving a symbolic batch (docs/onnx-mlir.md)
        gs = aten.permute.default(grad_output, [1, 0] + list(range(2, 2 + rank)))
    else:
        xs = aten.reshape.default(x, [n, groups, in_per_group] + sizes)
        xs = aten.permute.default(xs, [2, 1, 0] + spatial)
        xs = aten.reshape.default(xs, [in_per_group, groups * n] + sizes)
        gs = aten.reshape.default(grad_output, [n, groups, out_per_group] + outputs)
        gs = aten.permute.default(gs, [1, 2, 0] + spatial)
        gs = aten.reshape.default(gs, [groups * out_per_group, n] + outputs)
    full = aten.convolution.default(xs, gs, None, list(dilation), list(padding), list(stride), False, [0] * rank, groups)
    return aten.permute.default(fit_spatial(full, weight_size[2:]), [1, 0] + list(range(2, 2 + rank)))


def _weight_grad_gemm(grad_output, x, weight_size, stride, padding, dilation) -> torch.Tensor:
    """im2col (groups 1): columns ``[N*O, Cin*K]`` from channels-last windows stacked channel-major, one MatMul."""
    cols = _channels_last_columns(x, list(weight_size[2:]), stride, padding, dilation, _spatial(grad_output))
    product = aten.mm.default(_channel_rows(grad_output), cols)  # [Cout, Cin*K]
    return aten.reshape.default(product, list(weight_size))


def _weight_grad_gemm_channel_first(grad_output, x, weight_size, stride, padding, dilation) -> torch.Tensor:
    """im2col from the batch-transposed input (groups 1): columns ``[Cin*K, N*O]``, one Gemm."""
    cols = _channel_first_columns(x, list(weight_size[2:]), stride, padding, dilation, _spatial(grad_output))
    product = aten.mm.default(_channel_rows(grad_output), aten.t.default(cols))  # a Gemm (transB): [Cout, Cin*K]
    return aten.reshape.default(product, list(weight_size))


def window_indices(kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                   outputs: Sequence[int]) -> np.ndarray:
    """``[O*K]`` int64 (output position major, kernel offset minor): where window ``o``'s offset ``j`` reads
    the flattened spatial grid of ``_pad_to_windows``, ``o*s + j*d`` per dim."""
    grid = [(o - 1) * s + d * (k - 1) + 1 for o, k, s, d in zip(outputs, kernel, stride, dilation, strict=True)]
    steps = np.array([math.prod(grid[axis + 1:]) for axis in range(len(grid))], np.int64)

    def flat(spans: list[np.ndarray]) -> np.ndarray:  # every combination (row-major) as a flat grid index
        return np.stack(np.meshgrid(*spans, indexing="ij"), -1).reshape(-1, len(spans)) @ steps

    origins = flat([np.arange(o) * s for o, s in zip(outputs, stride, strict=True)])
    offsets = flat([np.arange(k) * d for k, d in zip(kernel, dilation, strict=True)])
    return (origins[:, None] + offsets[None, :]).reshape(-1)


def _padded_rows(x, kernel, stride, padding, dilation, outputs) -> torch.Tensor:
    """``x`` ``[N, Cin, L...]`` channels-last, padded to exactly what the windows read, as ``[N, Lp, Cin]``: the
    rows that ``window_indices`` index."""
    padded = _pad_to_windows(to_channels_last(x), kernel, stride, padding, dilation, outputs, first=1)
    return aten.reshape.default(padded, [-1, math.prod(_spatial(padded, channels_last=True)), x.shape[1]])


def _weight_grad_gather(grad_output, x, weight_size, stride, padding, dilation, parts: int = 1) -> torch.Tensor:
    """im2col by one Gather (groups 1): the padded channels-last input ``[N, Lp, Cin]`` gathered at
    ``window_indices`` into columns ``[N*O, K*Cin]`` (offset-major), one MatMul ``grad_output [Cout, N*O] @
    columns``, then the weight-sized product ``[Cout, k..., Cin]`` transposed to the weight's layout. The
    Gather copies whole ``Cin`` rows, as the strided slices of the other im2col forms do, in one node.
    ``parts``: one Gather ``[N*O, K_g*Cin]`` and one MatMul per group of consecutive kernel offsets
    (``_offset_groups``; ``gather_offsets``: one offset each), the products concatenated: the same products,
    with a ``parts``-th of the columns alive at a time."""
    in_channels, out_channels = x.shape[1], grad_output.shape[1]
    kernel, outputs = list(weight_size[2:]), _spatial(grad_output)
    count = math.prod(kernel)
    rows = _padded_rows(x, kernel, stride, padding, dilation, outputs)
    index = window_indices(kernel, stride, dilation, outputs).reshape(-1, count)  # [O, K]
    products, grad_rows = [], None
    for group in _offset_groups(count, parts):
        part = np.ascontiguousarray(index[:, group.start:group.stop]).reshape(-1)
        cols = aten.reshape.default(aten.index_select.default(rows, 1, torch.from_numpy(part)),
                                    [-1, len(group) * in_channels])
        grad_rows = _channel_rows(grad_output) if grad_rows is None else grad_rows  # [Cout, N*O]
        products.append(aten.mm.default(grad_rows, cols))  # [Cout, K_g*Cin]
    product = products[0] if len(products) == 1 else aten.cat.default(products, 1)  # [Cout, K*Cin]
    product = aten.reshape.default(product, [out_channels] + kernel + [in_channels])
    return aten.permute.default(product, [0, len(kernel) + 1] + list(range(1, len(kernel) + 1)))


def transposed_output_size(
    x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, output_padding
) -> list[int]:
    return [
        (i - 1) * s - 2 * p + d * (k - 1) + op + 1
        for i, k, s, p, d, op in zip(_spatial(x), weight.shape[2:], stride, padding, dilation, output_padding, strict=True)
    ]


def _bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    return aten.sum.dim_IntList(grad_output, [0] + list(range(2, grad_output.dim())))


def _channels_last_columns(x, kernel, stride, padding, dilation, outputs) -> torch.Tensor:
    """im2col of ``x`` ``[N, Cin, L...]`` as ``[N*O, Cin*K]`` (channel-major: the weight's layout): the windows
    of the channels-last input ``[N, L..., Cin]``, whose slices copy whole ``Cin`` rows."""
    rank, count = x.dim() - 2, math.prod(kernel)
    windows = window_slices(to_channels_last(x), kernel, stride, padding, dilation, outputs, first=1)
    axis = rank + 2  # stacked after Cin: channel-major
    cols = windows[0] if count == 1 else aten.cat.default([aten.unsqueeze.default(w, axis) for w in windows], axis)
    return aten.reshape.default(cols, [-1, x.shape[1] * count])


def _channel_first_columns(x, kernel, stride, padding, dilation, outputs) -> torch.Tensor:
    """im2col of ``x`` ``[N, Cin, L...]`` as ``[Cin*K, N*O]`` (channel-major: the weight's layout): the
    windows of the batch-transposed input ``[Cin, N, L...]``, whose slices copy whole rows."""
    xt = aten.permute.default(x, [1, 0] + list(range(2, x.dim())))  # [Cin, N, L...]
    windows = window_slices(xt, kernel, stride, padding, dilation, outputs)
    cols = aten.cat.default([aten.unsqueeze.default(w, 1) for w in windows], 1)  # [Cin, K, N, O...]
    return aten.reshape.default(cols, [x.shape[1] * math.prod(kernel), -1])


def _selected_columns(x, kernel, stride, padding, dilation, outputs) -> torch.Tensor:
    """im2col of ``x`` ``[N, Cin, L...]`` as ``[Cin*K, N*O]`` by one MatMul of ``x`` as it is, ``[N*Cin, L]``,
    with a constant 0/1 ``[L, K*O]`` (``scatter_matrix`` transposed), then one Transpose: no per-offset
    Slice. Exact."""
    n, in_channels, sizes = x.shape[0], x.shape[1], _spatial(x)
    positions, count = math.prod(outputs), math.prod(kernel)
    select = scatter_matrix(sizes, kernel, stride, padding, dilation, outputs).reshape(positions, count, -1)
    select = select.transpose(2, 1, 0).reshape(-1, count * positions)  # [L, K*O]
    cols = aten.mm.default(aten.reshape.default(x, [-1, math.prod(sizes)]), constant(select, x))  # [N*Cin, K*O]
    cols = aten.permute.default(aten.reshape.default(cols, [n, in_channels, count, positions]), [1, 2, 0, 3])
    return aten.reshape.default(cols, [in_channels * count, -1])


def _forward_product(x: torch.Tensor, weight: torch.Tensor, outputs: Sequence[int]) -> str:
    """How ``_forward_gemm`` multiplies: ``select`` (the selection-MatMul columns while the input plane is small
    against ``Cout``, ``targets.select_is_cheap``) times the weight rows, else ``targets.conv_forward_product``'s
    form (``weight_rows``, or ``rows_gemm``/``rows_matmul`` over the channels-last columns)."""
    if targets.select_is_cheap(weight.shape[0], _spatial(x)):
        return "select"
    batch = x.shape[0] if isinstance(x.shape[0], int) else 1  # a symbolic batch: at least one sample
    return targets.conv_forward_product(batch * math.prod(outputs), math.prod(weight.shape[1:]), weight.shape[0])


def _forward_gemm(x, weight, stride, padding, dilation, outputs) -> torch.Tensor:
    """``conv(x, weight)`` (groups 1) as ``weight [Cout, Cin*K] @ columns [Cin*K, N*O]``: the columns by
    a selection MatMul while the input plane is small against ``Cout`` (``targets.select_is_cheap``), else
    the windows of the batch-transposed input stacked channel-major. Or, as ``targets.conv_forward_product``
    picks, the transposed product ``columns [N*O, Cin*K] @ weight^T`` (``_forward_rows``)."""
    rank, out_channels, kernel = x.dim() - 2, weight.shape[0], list(weight.shape[2:])
    product_form = _forward_product(x, weight, outputs)
    if product_form not in ("select", "weight_rows"):
        return _forward_rows(x, weight, stride, padding, dilation, outputs, product_form)
    columns = _selected_columns if product_form == "select" else _channel_first_columns
    cols = columns(x, kernel, stride, padding, dilation, outputs)
    product = aten.mm.default(_weight_rows(weight), cols)  # [Cout, N*O]
    product = aten.reshape.default(product, [out_channels, -1] + outputs)
    return aten.permute.default(product, [1, 0] + list(range(2, 2 + rank)))


def _forward_rows(x, weight, stride, padding, dilation, outputs, product_form: str) -> torch.Tensor:
    """``conv(x, weight)`` (groups 1) as ``columns [N*O, Cin*K] @ weight^T [Cin*K, Cout]``, the columns from
    the channels-last windows, the weight as ``product_form`` reads it (``_transposed_weight``). Where
    ``targets.column_parts`` cuts the columns, they are offset-major, gathered and multiplied per range of output
    positions (``_rows_in_parts``). The product ``[N, O..., Cout]`` is moved channels-first."""
    rank, in_channels, out_channels, kernel = x.dim() - 2, x.shape[1], weight.shape[0], list(weight.shape[2:])
    parts = min(targets.column_parts(in_channels, out_channels, kernel, outputs, _spatial(x)), math.prod(outputs))
    if parts > 1:
        transposed = _transposed_weight(weight, product_form, offset_major=True)
        product = _rows_in_parts(x, transposed, kernel, stride, padding, dilation, outputs, parts)
    else:
        cols = _channels_last_columns(x, kernel, stride, padding, dilation, outputs)
        product = aten.mm.default(cols, _transposed_weight(weight, product_form, offset_major=False))
    product = aten.reshape.default(product, [-1] + list(outputs) + [out_channels])
    return aten.permute.default(product, [0, rank + 1] + list(range(1, rank + 1)))


def _transposed_weight(weight: torch.Tensor, product_form: str, offset_major: bool) -> torch.Tensor:
    """A Conv weight as ``[Cin*K, Cout]``, rows by input channel then kernel offset (``offset_major``: by offset
    then channel): ``rows_gemm`` the transpose of its ``[Cout, Cin*K]`` rows, which a Gemm reads as they are
    (``transB``); ``rows_matmul`` one Transpose of weight size."""
    out_channels, spatial = weight.shape[0], list(range(2, weight.dim()))
    order = [0, *spatial, 1] if offset_major else [0, 1, *spatial]
    if product_form == "rows_gemm":
        rows = (aten.reshape.default(aten.permute.default(weight, order), [out_channels, -1]) if offset_major
                else _weight_rows(weight))
        return aten.t.default(rows)
    return aten.reshape.default(aten.permute.default(weight, order[1:] + [0]), [-1, out_channels])


def _rows_in_parts(x, transposed, kernel, stride, padding, dilation, outputs, parts: int) -> torch.Tensor:
    """``columns [N*O, K*Cin] @ transposed [K*Cin, Cout]`` (offset-major) as ``[N, O, Cout]``, in ``parts`` ranges of
    output positions: each range's columns one Gather of ``_padded_rows`` at its ``window_indices``, times the
    weight, the products concatenated. A ``parts``-th of the columns is alive at a time; the gathers are not the
    weight gradient's (``gather_parts``: groups of kernel offsets), so no merge keeps them alive until the backward."""
    count = math.prod(kernel)
    rows = _padded_rows(x, kernel, stride, padding, dilation, outputs)
    index = window_indices(kernel, stride, dilation, outputs).reshape(-1, count)  # [O, K]
    products = []
    for chunk in np.array_split(index, parts):
        cols = aten.index_select.default(rows, 1, torch.from_numpy(np.ascontiguousarray(chunk).reshape(-1)))
        cols = aten.reshape.default(cols, [-1, count * x.shape[1]])  # [N*O_c, K*Cin]
        products.append(aten.reshape.default(aten.mm.default(cols, transposed), [-1, len(chunk), transposed.shape[1]]))
    return aten.cat.default(products, 1)


@lowers(aten.convolution.default)
def lower_convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """Transposed convolution as the input gradient of a Conv (so it never becomes ConvTranspose);
    a Conv's forward as the current target picks (``targets.conv_forward_form``)."""
    rank = weight.dim() - 2
    stride, padding, dilation = per_dim(stride, rank), per_dim(padding, rank), per_dim(dilation, rank)
    if not transposed:
        outputs = [pooled_size(size, k, s, p, d, False)
                   for size, k, s, p, d in zip(_spatial(x), weight.shape[2:], stride, padding, dilation, strict=True)]
        if targets.conv_forward_form(groups, list(weight.shape[2:]), outputs) == "conv":
            return NotImplemented
        y = _forward_gemm(x, weight, stride, padding, dilation, outputs)
    else:
        size = transposed_output_size(x, weight, stride, padding, dilation, per_dim(output_padding, rank, 0))
        y = input_grad(x, weight, size, stride, padding, dilation, groups)
    return y if bias is None else aten.add.Tensor(y, aten.reshape.default(bias, [1, -1] + [1] * rank))


@lowers(aten.convolution_backward.default)
def convolution_backward(
    grad_output, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """(grad_input, grad_weight, grad_bias), each ``None`` where ``output_mask`` is false.

    A transposed convolution ``y = convT(x, w)`` is the input gradient of ``conv(., w)``, so
    its gradients are that Conv's forward (for x) and its weight gradient with the roles of
    input and grad_output exchanged (for w).
    """
    rank = weight.dim() - 2
    stride, padding, dilation = per_dim(stride, rank), per_dim(padding, rank), per_dim(dilation, rank)
    grad_input = grad_weight = grad_bias = None
    if transposed:
        if output_mask[0]:  # an output_padding >= stride makes this Conv one window longer than x
            conv = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, False, [0] * rank, groups)
            grad_input = fit_spatial(conv, _spatial(x))
        if output_mask[1]:
            grad_weight = weight_grad(x, grad_output, weight.shape, stride, padding, dilation, groups)
    else:
        if output_mask[0]:
            grad_input = input_grad(grad_output, weight, _spatial(x), stride, padding, dilation, groups)
        if output_mask[1]:
            grad_weight = weight_grad(grad_output, x, weight.shape, stride, padding, dilation, groups,
                                      forward_product=_forward_product(x, weight, _spatial(grad_output)))
    if output_mask[2]:
        grad_bias = _bias_grad(grad_output)
    return grad_input, grad_weight, grad_bias
