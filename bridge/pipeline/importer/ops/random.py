"""RandomUniform(Like), RandomNormal(Like) and Bernoulli, as in train-mode exports (the dynamo
exporter writes an in-place dropout or a stochastic depth as ``RandomUniformLike`` and a
comparison): their randomness is a graph input, as Dropout's is (see ``dropout.py``).

Each node reads ``<node name>.noise``, uniform [0, 1) values drawn by the runtime every step:
of the output's shape for a uniform or Bernoulli draw, with a trailing 2 for a normal draw
(Box-Muller: ``sqrt(-2 ln(1 - u0)) * cos(2 pi u1)``). The noise of a ``*Like`` op or Bernoulli
has the batch as dim 0, like its input; that of RandomUniform / RandomNormal (a static
``shape``) a leading 1, so that a symbolic batch never reaches it. The ``seed`` attribute is
ignored: every step draws new noise, as torch does.

bridge's eval graph has no noise inputs: there each node returns its median (``low + (high -
low) / 2``, ``mean``, ``p > 1/2``), which is NOT torch's ``eval()`` (the exported graph has no
train/eval switch), and a ``RandomOpInEvalWarning`` says so.
"""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import torch

from ....errors import BridgeWarning
from ..registry import converter
from .elementwise import onnx_to_torch_dtype


class RandomOpInEvalWarning(BridgeWarning):
    """The eval graph evaluates a random op at its median (a train-mode export has no eval switch)."""


def _dtype(ctx, default: torch.dtype) -> torch.dtype:
    return onnx_to_torch_dtype(ctx.attr("dtype")) if ctx.has_attr("dtype") else default


def _uniform(ctx, shape, dtype: torch.dtype, static: bool = False, normal: bool = False):
    """The node's uniform [0, 1) noise input of ``shape`` (with a trailing 2 for a ``normal`` draw;
    a ``static`` shape is read from a leading 1, see the module docstring); in the eval graph its
    median 0.5 (with a ``RandomOpInEvalWarning``)."""
    full = (*shape, 2) if normal else tuple(shape)
    if ctx.training:
        noise = ctx.random_uniform(SimpleNamespace(shape=(1, *full) if static else full, dtype=dtype))
        return noise[0] if static else noise
    warnings.warn(f"{ctx.node.op_type} node '{ctx.name}': bridge's eval graph uses its median, not a random "
                  "draw; a train-mode export has no eval() switch, so the eval loss is not torch's eval() loss "
                  "(export in eval mode for inference)", RandomOpInEvalWarning, stacklevel=2)
    return torch.full(full, 0.5, dtype=dtype)


def _normal(ctx, shape, dtype: torch.dtype, static: bool = False):
    """Standard normal values of ``shape`` from two uniform draws (Box-Muller); the eval graph's
    median 0."""
    noise = _uniform(ctx, shape, dtype, static, normal=True)
    if not ctx.training:
        return torch.zeros(tuple(shape), dtype=dtype)
    return torch.sqrt(-2.0 * torch.log(1.0 - noise[..., 0])) * torch.cos((2 * math.pi) * noise[..., 1])


def _static_shape(ctx) -> tuple[int, ...]:
    return tuple(ctx.ints(ctx.attr("shape", [])))


@converter("RandomUniformLike")
def random_uniform_like(ctx, x):
    dtype = _dtype(ctx, x.dtype)
    low, high = ctx.attr("low", 0.0), ctx.attr("high", 1.0)
    return low + (high - low) * _uniform(ctx, x.shape, dtype)


@converter("RandomUniform")
def random_uniform(ctx):
    dtype = _dtype(ctx, torch.float32)
    low, high = ctx.attr("low", 0.0), ctx.attr("high", 1.0)
    return low + (high - low) * _uniform(ctx, _static_shape(ctx), dtype, static=True)


@converter("RandomNormalLike")
def random_normal_like(ctx, x):
    dtype = _dtype(ctx, x.dtype)
    return ctx.attr("mean", 0.0) + ctx.attr("scale", 1.0) * _normal(ctx, x.shape, dtype)


@converter("RandomNormal")
def random_normal(ctx):
    dtype = _dtype(ctx, torch.float32)
    return ctx.attr("mean", 0.0) + ctx.attr("scale", 1.0) * _normal(ctx, _static_shape(ctx), dtype, static=True)


@converter("Bernoulli")
def bernoulli(ctx, p):
    """1 with probability ``p`` (``noise < p``), as the ``dtype`` attribute (default p's type)."""
    draw = _uniform(ctx, p.shape, p.dtype) < p
    return draw.to(_dtype(ctx, p.dtype))
