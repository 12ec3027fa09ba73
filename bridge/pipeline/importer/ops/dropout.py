"""Dropout, with its randomness fed through a graph input.

A compiled random op (RandomUniform, Bernoulli) gets its seed at compile time in onnx-mlir,
so it would repeat one mask at every step, and onnx-mlir's Dropout has no training mode.
In training each Dropout node therefore reads a graph input ``<node name>.noise`` (uniform
[0, 1) values of x's shape, role ``random``; the runtime draws it every step unless the
caller provides it) and computes ``y = x * (noise >= ratio) / (1 - ratio)``, torch's
inverted dropout with the mask ``noise >= ratio`` (kept with probability 1 - ratio).
"""
from __future__ import annotations

import numpy as np
import torch

from ..registry import converter


@converter("Dropout", static=(1,))
def dropout(ctx, x, ratio=None, training_mode=None):
    """Active whenever bridge trains: the ``training_mode`` input (and opset < 7's ``is_test``)
    describe the inference model, which is what bridge turns into a training step."""
    ratio = ctx.attr("ratio", 0.5) if ctx.opset < 12 or ratio is None else float(np.asarray(ratio).reshape(-1)[0])
    if not 0 <= ratio <= 1:
        raise ctx.unsupported(f"ratio={ratio} (outside [0, 1])")
    if not ctx.training or ratio == 0:
        keep = torch.ones_like(x, dtype=torch.bool)
        y = x
    else:
        keep = ctx.random_uniform(x) >= ratio
        y = x * keep.to(x.dtype) * (0.0 if ratio == 1 else 1 / (1 - ratio))
    return (y, keep)[:max(1, len([o for o in ctx.node.output if o]))]
