"""bridge's ``affine`` (bridge/pipeline/primitives.py): ``x * scale + bias`` per channel as one inference-form
``BatchNormalization`` (mean 0, variance 1, epsilon 0)."""
from __future__ import annotations

import numpy as np

from ....dtypes import TORCH_TO_NUMPY
from ...primitives import AFFINE
from ..builder import emits


@emits(AFFINE)
def emit_affine(b, node, x, scale, bias):
    channels, dtype = node.meta["val"].shape[1], node.meta["val"].dtype
    numpy_dtype = TORCH_TO_NUMPY[dtype]
    mean, variance = b.const(np.zeros(channels, numpy_dtype)), b.const(np.ones(channels, numpy_dtype))
    return b.op("BatchNormalization", x, scale, bias, mean, variance, epsilon=0.0)

