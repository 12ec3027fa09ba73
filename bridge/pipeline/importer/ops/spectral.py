"""Spectral ops: DFT as matrix products with cos/sin matrices, and the window functions.

A DFT of length n along one axis is two real MatMuls with constant ``cos(2 pi k t / n)`` and
``sin(2 pi k t / n)`` matrices (built in float64 at import): differentiable with the emitters
bridge already has and accepted by onnx-mlir (no complex types, no FFT op). It costs O(n^2)
per signal, which is fine for the short frames of audio front ends. Complex values are ONNX's
real representation: a last dim of 2 (real, imaginary), or 1 for a real signal.

HannWindow, HammingWindow and BlackmanWindow have only a static size: they are constants.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from ..registry import converter


def _fit(signal: torch.Tensor, length: int) -> torch.Tensor:
    """``signal`` (the transformed axis last) truncated or zero-padded to ``length``."""
    size = signal.shape[-1]
    return signal[..., :length] if size >= length else F.pad(signal, (0, length - size))


def _matrices(n_in: int, n_out: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``2 pi t k / n`` for t < n_in rows and k < n_out columns."""
    angle = 2 * np.pi * (np.outer(np.arange(n_in), np.arange(n_out)) % n) / n
    return torch.from_numpy(np.cos(angle)).to(dtype), torch.from_numpy(np.sin(angle)).to(dtype)


def _dft(real: torch.Tensor, imag: torch.Tensor | None, n: int, inverse: bool, onesided: bool):
    """(real, imaginary) of the DFT of ``real + i imag`` along the last axis (length ``n``)."""
    real = _fit(real, n)
    cos, sin = _matrices(n, n // 2 + 1 if onesided else n, n, real.dtype)
    sign = 1.0 if inverse else -1.0  # e^(sign i theta)
    out_real, out_imag = real @ cos, sign * (real @ sin)
    if imag is not None:
        imag = _fit(imag, n)
        out_real, out_imag = out_real - sign * (imag @ sin), out_imag + imag @ cos
    if inverse:
        out_real, out_imag = out_real / n, out_imag / n
    return out_real, out_imag


def _inverse_real(real: torch.Tensor, imag: torch.Tensor | None, n: int) -> torch.Tensor:
    """The real signal of length ``n`` whose one-sided spectrum is ``real + i imag`` (numpy's
    irfft: the other half is the conjugate mirror; the imaginary parts of bin 0 and n/2 drop)."""
    bins = n // 2 + 1
    weights = np.full(bins, 2.0)
    weights[0] = 1.0
    if n % 2 == 0:
        weights[-1] = 1.0
    cos, sin = _matrices(bins, n, n, real.dtype)
    scale = torch.from_numpy(weights[:, None] / n).to(real.dtype)
    out = _fit(real, bins) @ (cos * scale)
    if imag is not None:
        out = out - _fit(imag, bins) @ (sin * scale)
    return out


@converter("DFT", static=(1, 2))
def dft(ctx, x, dft_length=None, axis=None):
    """ONNX DFT (opset 17: ``axis`` attribute; 20: ``axis`` input), forward or ``inverse``,
    ``onesided`` (the first n/2 + 1 bins; inverse: a one-sided spectrum to a real signal)."""
    if ctx.opset < 20:
        axis = ctx.attr("axis", 1)
    else:
        axis = -2 if axis is None else int(np.asarray(axis).reshape(-1)[0])
    axis = axis % x.dim()
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    if x.shape[-1] not in (1, 2) or axis == x.dim() - 1:
        raise ctx.unsupported(f"an input of shape {list(x.shape)} with axis {axis} (the last dim must be "
                              "1 (real) or 2 (complex) and not the transformed axis)")
    real = x[..., 0].movedim(axis, -1)
    imag = x[..., 1].movedim(axis, -1) if x.shape[-1] == 2 else None
    size = real.shape[-1]
    if dft_length is not None:
        n = int(np.asarray(dft_length).reshape(-1)[0])
    else:
        n = 2 * (size - 1) if inverse and onesided else size
    if inverse and onesided:
        return _inverse_real(real, imag, n).movedim(-1, axis).unsqueeze(-1)
    out_real, out_imag = _dft(real, imag, n, inverse, onesided)
    return torch.stack([out_real.movedim(-1, axis), out_imag.movedim(-1, axis)], dim=-1)


def _window(ctx, size, cosines: tuple[float, ...]) -> np.ndarray:
    """``sum_j (-1)^j a_j cos(2 pi j t / N)`` for t < size: N = size (``periodic``) or size - 1."""
    length = int(np.asarray(size).reshape(-1)[0])
    period = length if ctx.attr("periodic", 1) else length - 1
    t = np.arange(length, dtype=np.float64)
    values = sum((-1) ** j * a * np.cos(2 * np.pi * j * t / period) for j, a in enumerate(cosines))
    return np.asarray(values, dtype=onnx.helper.tensor_dtype_to_np_dtype(ctx.attr("output_datatype", 1)))


@converter("HannWindow", static=(0,))
def hann_window(ctx, size):
    return _window(ctx, size, (0.5, 0.5))


@converter("HammingWindow", static=(0,))
def hamming_window(ctx, size):
    return _window(ctx, size, (25 / 46, 21 / 46))


@converter("BlackmanWindow", static=(0,))
def blackman_window(ctx, size):
    return _window(ctx, size, (0.42, 0.5, 0.08))
