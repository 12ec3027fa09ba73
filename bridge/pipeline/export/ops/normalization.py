"""bridge's ``affine`` (bridge/pipeline/primitives.py): ``x * scale + bias`` per channel, a Mul and an Add, or
one inference-form ``BatchNormalization`` (mean 0, variance 1, epsilon 0) where the target asks for it."""
from __future__ import annotations

import numpy as np

from ....dtypes import TORCH_TO_NUMPY
from ...primitives import AFFINE
from ...targets import enabled
from ..builder import emits


@emits(AFFINE)
def emit_affine(b, node, x, scale, bias):
    channels, dtype = node.meta["val"].shape[1], node.meta["val"].dtype
    if scale.dtype != dtype or not enabled("affine_as_batch_norm"):
        # float32 scale and bias of a float16/bfloat16 x (mixed precision): computed in float32, rounded once
        shape, per_channel = list(node.meta["val"].shape), [1, channels] + [1] * (len(node.meta["val"].shape) - 2)
        wide = b.cast(x, scale.dtype)
        scaled = b.op("Mul", wide, b.reshape(scale, per_channel), shape=shape, dtype=scale.dtype)
        return b.cast(b.op("Add", scaled, b.reshape(bias, per_channel), shape=shape, dtype=scale.dtype), dtype)
    numpy_dtype = TORCH_TO_NUMPY[dtype]
    mean, variance = b.const(np.zeros(channels, numpy_dtype)), b.const(np.ones(channels, numpy_dtype))
    return b.op("BatchNormalization", x, scale, bias, mean, variance, epsilon=0.0)

