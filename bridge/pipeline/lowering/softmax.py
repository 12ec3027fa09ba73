"""Softmax backward that a fully masked row cannot poison.

A row of scores that is ``-inf`` everywhere (an attention row whose every key is masked)
has a NaN softmax (``exp(-inf - -inf)``); HF-style exports then replace the NaN with 0
(``Where(IsNaN(p), 0, p)``), so the forward is finite. torch's backward
``p * (g - sum(p * g))`` still multiplies by the NaN ``p``: NaN gradients for Q and K, and
NaN weights after one step. Here the backward uses ``p`` with its NaNs replaced by 0 (found
as ``p != p``: IsNaN needs opset 20 in onnx-mlir), so such a row gets a zero gradient (it
has no effect on the loss); every other row gets torch's gradient exactly. The forward is
unchanged (still NaN before the model's own masking).
"""
from __future__ import annotations

import torch

from . import lowers

aten = torch.ops.aten


@lowers(aten._softmax_backward_data.default)
def softmax_backward(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    probs = torch.where(output == output, output, torch.zeros((), dtype=output.dtype))
    grad_input = probs * (grad - torch.sum(probs * grad, dim=dim, keepdim=True))
    return grad_input.to(input_dtype)
