"""slice_scatter / select_scatter lowerings (the backward of slicing) vs ATen, eagerly."""
from __future__ import annotations

import pytest
import torch

from bridge.pipeline.lowering.slicing import select_scatter, slice_scatter

aten = torch.ops.aten


@pytest.mark.parametrize("dim, start, end, step", [
    (0, 1, 3, 1), (1, -4, None, 1), (1, 0, 7, 2), (0, None, None, 3), (1, 2, 2, 1), (1, 5, 2**62, 1), (-1, 1, -1, 2),
])
def test_slice_scatter_matches_aten(dim, start, end, step):
    x = torch.randn(5, 7)
    index = [slice(None)] * 2
    index[dim] = slice(start, end, step)
    src = torch.randn(x[tuple(index)].shape)
    assert torch.equal(slice_scatter(x, src, dim, start, end, step), aten.slice_scatter(x, src, dim, start, end, step))


@pytest.mark.parametrize("dim, index", [(0, 0), (0, -2), (1, 6)])
def test_select_scatter_matches_aten(dim, index):
    x = torch.randn(5, 7)
    src = torch.randn(x.select(dim, index).shape)
    assert torch.equal(select_scatter(x, src, dim, index), aten.select_scatter(x, src, dim, index))
