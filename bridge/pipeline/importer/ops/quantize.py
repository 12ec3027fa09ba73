"""Quantization: QuantizeLinear/DequantizeLinear as fake quantization; the integer-only ops.

QuantizeLinear's result is carried as a floating tensor holding the quantized integers (the
values are those of the spec: ``saturate(round_half_even(x / scale) + zero_point)``), so that a
QuantizeLinear -> DequantizeLinear pair ("QDQ") trains as fake quantization: the rounding has a
straight-through gradient (identity), the saturation a zero one outside the range, as torch's
``fake_quantize_per_tensor_affine``. Scales and zero points are quantization parameters, not
weights: they get no gradient (as in torch's quantization-aware training). A graph output of an
integer type is cast to it at the end (``program._as_output``). docs/quantization.md.

DynamicQuantizeLinear, MatMulInteger and QLinearMatMul compute exactly as the spec (integer
matmul, round half to even, saturation), so inference matches; a training conversion in which a
gradient would have to flow through them is refused: integer arithmetic has no gradient.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch

from ....errors import UnsupportedOpError
from ..program import eager
from ..registry import NodeContext, converter

# (min, max) of the integer types a QuantizeLinear may produce.
_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.uint16: (0, 65535), torch.int16: (-32768, 32767)}
_NARROW = {onnx.TensorProto.UINT4: (0, 15), onnx.TensorProto.INT4: (-8, 7)}


def _round_ste(value: torch.Tensor) -> torch.Tensor:
    """Round half to even forward, identity backward (straight-through estimator)."""
    return value + (torch.round(value) - value).detach()


def _broadcast(ctx: NodeContext, param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scale or zero point shaped to broadcast against ``x``: per tensor (0-d or one element),
    per axis (1-D along ``axis``) or per block (``block_size`` along ``axis``, opset 21)."""
    if param.dim() == 0 or (param.dim() == 1 and param.shape[0] == 1 and x.dim() != 1):
        return param.reshape(())
    axis = ctx.attr("axis", 1) % x.dim()
    block = ctx.attr("block_size", 0)
    if block:
        index = torch.from_numpy(np.arange(x.shape[axis]) // block)
        return param.index_select(axis, index)
    return param.reshape([-1 if d == axis else 1 for d in range(x.dim())])


def _quantized_range(ctx: NodeContext, zero_point) -> tuple[int, int]:
    """The saturation range: the zero point's type, else ``output_dtype`` (opset 21), else uint8."""
    if zero_point is not None:
        dtype = _torch_dtype(zero_point)
    elif ctx.attr("output_dtype", 0):
        code = ctx.attr("output_dtype")
        if code in _NARROW:
            return _NARROW[code]
        dtype = getattr(torch, onnx.helper.tensor_dtype_to_np_dtype(code).name, None)
    else:
        dtype = torch.uint8
    if dtype not in _RANGES:
        raise ctx.unsupported(f"quantizing to {dtype} (bridge fake-quantizes to 4/8/16-bit integers)")
    return _RANGES[dtype]


def _torch_dtype(value) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else getattr(torch, value.dtype.name)


def _as_float(value, dtype: torch.dtype) -> torch.Tensor | None:
    """A scale or zero point as a float tensor that takes no gradient; a constant (numpy) is
    converted in numpy, so no int -> float Cast reaches the graph (outside onnx-mlir's table)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, dtype=getattr(np, str(dtype).removeprefix("torch."))))  # a copy
    return value.detach().to(dtype)


def _folded(fn, ctx: NodeContext, x, scale, zero_point, dtype: torch.dtype):
    """``fn(ctx, x, scale, zero_point)`` on tensors: computed at import (numpy out) when every input
    is known before the model runs, else traced; the scale and zero point as ``dtype``."""
    if all(v is None or isinstance(v, np.ndarray) for v in (x, scale, zero_point)):
        with eager():
            out = fn(ctx, torch.from_numpy(np.array(x)), _as_float(scale, dtype), _as_float(zero_point, dtype))
        return out.numpy()
    x = torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x
    return fn(ctx, x, _as_float(scale, dtype), _as_float(zero_point, dtype))


def _quantize(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bounds=(0, 255)):
    value = _round_ste(x / _broadcast(ctx, scale, x))
    if zero_point is not None:
        value = value + _broadcast(ctx, zero_point, x)
    # The gradient passes where the rounded code is inside the range, bounds included, as torch's
    # fake_quantize_*_affine (``torch.clamp``'s gradient is 0 at the bounds).
    low, high = bounds
    inside = (value >= low) & (value <= high)
    return torch.where(inside, value, torch.clamp(value.detach(), low, high))


def _dequantize(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None):
    value = x.to(scale.dtype)
    if zero_point is not None:
        value = value - _broadcast(ctx, zero_point, x)
    return value * _broadcast(ctx, scale, x)


@converter("QuantizeLinear", raw=True)
def quantize_linear(ctx, x, scale, zero_point=None):
    """``saturate(round_half_even(x / scale) + zero_point)``, carried in ``x``'s float type."""
    bounds = _quantized_range(ctx, zero_point)
    return _folded(lambda c, *args: _quantize(c, *args, bounds=bounds), ctx, x, scale, zero_point, _torch_dtype(x))


@converter("DequantizeLinear", raw=True)
def dequantize_linear(ctx, x, scale, zero_point=None):
    """``(x - zero_point) * scale`` in the scale's type (``x``: integers or QuantizeLinear's carrier)."""
    return _folded(_dequantize, ctx, x, scale, zero_point, _torch_dtype(scale))


def _refuse_gradient(ctx: NodeContext, *values) -> None:
    """Refuse a node that a gradient would have to cross (an input that requires one)."""
    if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
        raise UnsupportedOpError(
            f"{ctx.node.op_type} node '{ctx.name}': a trainable weight's gradient would have to flow through "
            "this integer-only op, and integer arithmetic has no gradient; train with QDQ fake quantization "
            "(QuantizeLinear -> DequantizeLinear around float weights and MatMul/Conv), or freeze the weights "
            "in front of this node (frozen=)"
        )


def _integer(value: torch.Tensor, zero_point=None) -> torch.Tensor:
    """``value - zero_point`` as int64 (a fake-quantization carrier holds integers exactly)."""
    value = value.to(torch.int64)
    return value if zero_point is None else value - zero_point.to(torch.int64)


@converter("DynamicQuantizeLinear")
def dynamic_quantize_linear(ctx, x):
    """uint8 quantization with a scale and zero point from the data's range (including 0)."""
    _refuse_gradient(ctx, x)
    high = torch.clamp(torch.amax(x), min=0.0)
    low = torch.clamp(torch.amin(x), max=0.0)
    scale = torch.where(high == low, torch.ones_like(high), high - low) / 255.0
    zero_point = torch.round(torch.clamp(0.0 - low / scale, 0.0, 255.0))
    y = torch.clamp(torch.round(x / scale) + zero_point, 0.0, 255.0)
    return y.to(torch.uint8), scale, zero_point.to(torch.uint8)


@converter("MatMulInteger")
def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    """``(a - a_zero_point) @ (b - b_zero_point)`` in int32; a 1-D ``a_zero_point`` is per row."""
    _refuse_gradient(ctx, a, b)
    if a_zero_point is not None and a_zero_point.dim() == 1 and a.dim() > 1:
        a_zero_point = a_zero_point.unsqueeze(-1)
    return torch.matmul(_integer(a, a_zero_point), _integer(b, b_zero_point)).to(torch.int32)


@converter("QLinearMatMul")
def qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    """The integer matmul rescaled by ``a_scale * b_scale / y_scale`` (in the scales' type),
    rounded half to even, plus ``y_zero_point``, saturated to its type."""
    _refuse_gradient(ctx, a, b)
    product = torch.matmul(_integer(a, a_zero_point), _integer(b, b_zero_point))
    multiplier = (a_scale * b_scale / y_scale).to(torch.float64)
    low, high = _RANGES[y_zero_point.dtype]
    y = torch.round(product.to(torch.float64) * multiplier) + y_zero_point.to(torch.float64)
    return torch.clamp(y, low, high).to(y_zero_point.dtype)
