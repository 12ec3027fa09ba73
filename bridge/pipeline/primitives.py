"""bridge's own ATen-level ops: traced as they are (no decomposition) and emitted as one ONNX op each
by bridge/pipeline/export/ops; written by the importer (the writer's shared vocabulary, as ``geometry.py`` is
for convolution arithmetic).

``affine(x, scale, bias)``: ``x * scale + bias`` with ``scale`` and ``bias`` ``[C]``, per channel (dim 1
of ``x``, rank >= 2). Emitted as an inference-form ``BatchNormalization`` (mean 0, variance 1,
epsilon 0: ``x * scale / sqrt(1) + bias``), which onnxruntime runs in one pass, bit for bit the Mul
and Add it replaces and faster than those two (quiet, 2 threads: [8, 64, 32, 32] 0.065 vs 0.092 ms,
[8, 128, 8, 8] 0.016 vs 0.072 ms); onnx-mlir and IREE take the inference form.
onnxruntime parallelizes it over channels only: one channel runs on one thread (Adam's update
through it on [1, 1, numel] was slower than its Mul and Add). Not differentiable: it serves computations
whose gradient is written by hand (BatchNorm's forward and backward inside their autograd.Function).
"""
from __future__ import annotations

import torch


@torch.library.custom_op("bridge::affine", mutates_args=())
def affine(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x * scale + bias``, ``scale`` and ``bias`` ``[C]`` along dim 1 of ``x``."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    return x * scale.reshape(shape) + bias.reshape(shape)


@affine.register_fake
def _affine_fake(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


AFFINE = torch.ops.bridge.affine.default  # the OpOverload a traced graph holds
