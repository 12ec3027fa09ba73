"""bridge's own ATen-level ops: traced as they are (no decomposition) and emitted by
bridge/pipeline/export/ops; written by the importer (the writer's shared vocabulary, as ``geometry.py`` is
for convolution arithmetic).

``affine(x, scale, bias)``: ``x * scale + bias`` with ``scale`` and ``bias`` ``[C]``, per channel (dim 1
of ``x``, rank >= 2), in ``x``'s dtype (float32 ``scale`` and ``bias`` of a float16 ``x``, under mixed
precision: computed in float32, rounded once, as torch's BatchNorm kernel does). Emitted as a Mul and an Add, or, where the target enables ``affine_as_batch_norm``
(bridge/pipeline/targets.py), as an inference-form ``BatchNormalization`` (mean 0, variance 1, epsilon 0:
``x * scale / sqrt(1) + bias``), bit for bit the same. Not differentiable: it serves computations whose
gradient is written by hand (BatchNorm's forward and backward inside their autograd.Function).
"""
from __future__ import annotations

import torch


@torch.library.custom_op("bridge::affine", mutates_args=())
def affine(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``x * scale + bias``, ``scale`` and ``bias`` ``[C]`` along dim 1 of ``x``."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x * scale.reshape(shape) + bias.reshape(shape)).to(x.dtype)


@affine.register_fake
def _affine_fake(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


AFFINE = torch.ops.bridge.affine.default  # the OpOverload a traced graph holds
