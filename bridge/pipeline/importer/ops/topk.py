"""Selection: TopK.

The indices come from ``torch.topk`` of the detached input (ONNX TopK in the graph); the
values are ``gather(x, axis, indices)``, so the gradient flows to the selected elements through
Gather's backward (a one-hot sum, see ``bridge.pipeline.lowering.embedding``) and TopK needs none.
"""
from __future__ import annotations

import numpy as np
import torch

from ..registry import converter


@converter("TopK", static=(1,))
def convert_topk(ctx, x, k=None):
    """The ``k`` largest (``largest=1``) or smallest elements along ``axis``, always sorted (ONNX
    leaves the order free for ``sorted=0``); ties keep the lower index first, as ONNX specifies."""
    k = ctx.attr("k") if ctx.opset < 10 else int(np.asarray(k).reshape(-1)[0])
    axis = ctx.attr("axis", -1) % x.dim()
    largest = bool(ctx.attr("largest", 1))
    _, indices = torch.topk(x.detach(), k, axis, largest=largest, sorted=True)
    return torch.gather(x, axis, indices), indices
