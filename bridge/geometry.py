"""Window geometry shared by the importer, the lowerings and the exporter (torch-free).

Convolution and pooling arithmetic on plain ints and numpy: how an ATen int-list argument
expands per spatial dim, torch's pooled output size, the per-window divisor of average
pooling, and per-dim pads as ``F.pad``'s list. One copy here, imported by
``bridge.pipeline.importer.ops``, ``bridge.pipeline.lowering`` and ``bridge.pipeline.export.ops``, so that the three stages
agree on every size.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def per_dim(values: Sequence[int], rank: int, default: int | None = None) -> list[int]:
    """An ATen int-list argument (empty, one value, or one per spatial dim) -> one per dim."""
    values = list(values)
    if not values:
        return [default] * rank
    return values * rank if len(values) == 1 else values


def torch_pad(begins: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Per-dim (begin, end) pads -> ``F.pad``'s / ``constant_pad_nd``'s list (last dim first)."""
    pad = []
    for begin, end in reversed(list(zip(begins, ends, strict=True))):
        pad += [begin, end]
    return pad


def pooled_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling output size (a ceil_mode window must start inside the input or left pad)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def avg_pool_divisor(
    sizes, outputs, kernel, stride, padding, ceil_mode: bool, count_include_pad: bool, divisor_override
) -> np.ndarray:
    """torch's per-window divisor, shape ``outputs``."""
    if divisor_override:
        return np.full(outputs, float(divisor_override))
    factors = []
    for size, o, k, s, p in zip(sizes, outputs, kernel, stride, padding, strict=True):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, size + p)
        if count_include_pad:
            factors.append(end - start)
        else:
            factors.append(np.minimum(end, size) - np.maximum(start, 0))
    divisor = np.ones([], dtype=np.float64)
    for factor in factors:
        divisor = np.multiply.outer(divisor, factor.astype(np.float64))
    return divisor
