"""zoo.harness's check that a batch keeps a torch module off decisions (ReLU kinks, max-pool ties)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zoo.harness import near_decisions, safe_rows, window_gaps


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(3, 2, 1, False), (3, 2, 0, True), (2, 2, 0, False)])
def test_window_gaps_are_each_windows_largest_minus_second_largest(kernel, stride, padding, ceil_mode):
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode)
    gaps = window_gaps(x, out, [kernel, kernel], [stride, stride], [padding, padding], 1, ceil_mode)
    padded = F.pad(x, [padding] * 4, value=-torch.inf)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            window = padded[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel].flatten(2)
            top = window.topk(2, dim=2).values
            assert torch.equal(gaps[:, :, i, j], top[..., 0] - top[..., 1])


class _Net(torch.nn.Module):
    """relu((x0 + x1) + x2), summed in that order."""

    def forward(self, x):
        return F.relu(x[:, 0] + x[:, 1] + x[:, 2])


# row 0 is 1e-8 in float64 and exactly 0 in float32 (1 + 1e-8 rounds to 1): at the kink
AT_KINK = np.array([[1.0, 1e-8, -1.0], [0.5, 0.25, 0.125]], np.float32)
OFF_KINK = np.array([[0.5, 0.25, 0.125], [0.1, 0.2, 0.3]], np.float32)


def test_near_decisions_flags_a_functional_relu_input_within_float32_rounding_of_zero():
    hits = near_decisions(_Net(), {"x": AT_KINK})
    assert [(where, count) for where, count, *_ in hits] == [(" (relu)", 1)]
    assert near_decisions(_Net(), {"x": OFF_KINK}) == []


def test_safe_rows_keeps_a_safe_first_draw_and_fails_clearly_when_none_is_safe():
    safe = {"x": OFF_KINK}
    assert safe_rows(_Net(), lambda attempt: safe, "net") is safe
    draws = {0: {"x": AT_KINK}, 1: safe}
    assert safe_rows(_Net(), draws.__getitem__, "net") is safe
    with pytest.raises(AssertionError, match="none of 20 draws"):
        safe_rows(_Net(), lambda attempt: {"x": AT_KINK}, "net")
