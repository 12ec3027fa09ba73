"""Activation backward ops.

``threshold_backward`` (ReLU's backward): ``grad * ceil(clamp(x - threshold, 0, 1))``, a float
mask (exactly 0 or 1) by one Clip and a Ceil, and one Mul, instead of torch's
``where(x <= threshold, 0, grad)``, whose Where (with its LessOrEqual) is slower in onnxruntime
(docs/lowerings/conv_pool.md). A bool -> float Cast would be one pass less, but onnx-mlir casts only between floats.
The two differ only on non-finite values: a NaN ``x`` gives NaN (torch: ``grad``), and an
infinite or NaN ``grad`` where ``x <= threshold`` gives NaN (torch: 0).
"""
from __future__ import annotations

import torch

from . import lowers

aten = torch.ops.aten


@lowers(aten.threshold_backward.default)
def threshold_backward(grad_output: torch.Tensor, x: torch.Tensor, threshold) -> torch.Tensor:
    """``grad_output`` where ``x > threshold``, else 0."""
    shifted = x if threshold == 0 else aten.sub.Tensor(x, threshold)
    mask = aten.ceil.default(aten.clamp.default(shifted, 0.0, 1.0))
    return aten.mul.Tensor(grad_output, mask)
