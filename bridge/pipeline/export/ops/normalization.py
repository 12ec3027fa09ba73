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
    if not enabled("affine_as_batch_norm"):
        shape, per_channel = list(node.meta["val"].shape), [1, channels] + [1] * (len(node.meta["val"].shape) - 2)
        scaled = b.op("Mul", x, b.reshape(scale, per_channel), shape=shape, dtype=dtype)
        return b.op("Add", scaled, b.reshape(bias, per_channel), shape=shape, dtype=dtype)
    numpy_dtype = TORCH_TO_NUMPY[dtype]
    mean, variance = b.const(np.zeros(channels, numpy_dtype)), b.const(np.ones(channels, numpy_dtype))
    return b.op("BatchNormalization", x, scale, bias, mean, variance, epsilon=0.0)

