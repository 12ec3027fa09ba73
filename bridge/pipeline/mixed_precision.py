"""Mixed precision: torch's autocast around the forward, torch.amp.GradScaler's dynamic loss scaling in the graph.

The forward and the loss are traced under ``torch.autocast("cpu", dtype)``, so the step computes in
float16/bfloat16 exactly where torch's autocast would (its casts are recorded as ``_to_copy`` ops, and
the backward of a low-precision op is low-precision too); weights, gradients and optimizer state stay
float32. Loss scaling is GradScaler's rule as tensor ops on two state inputs (``LOSS_SCALE``,
``GROWTH_TRACKER``): the loss is multiplied by the scale, the gradients unscaled by its float32
reciprocal, a non-finite gradient keeps every weight, optimizer state and ``step`` (``Where``, as
GradScaler skips ``optimizer.step()``) and multiplies the scale by ``backoff_factor``;
``growth_interval`` good steps in a row multiply it by ``growth_factor`` (if that stays finite).
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidOptionError

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}

# GradScaler's constructor arguments that say how the scale evolves (``device`` and ``enabled`` are not among them)
_SCALER_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True)
class Precision:
    """The compute precision of the forward and backward (``dtype`` None: float32 throughout) and the
    GradScaler options of its loss scaling (``grad_scaler`` None: no loss scaling)."""

    name: str = "fp32"
    dtype: torch.dtype | None = None
    grad_scaler: dict[str, Any] | None = None

    @property
    def loss_scaling(self) -> bool:
        return self.grad_scaler is not None


def make_precision(precision: str, grad_scaler_options: Mapping[str, Any] | bool | None = None) -> Precision:
    """Resolve ``precision=`` and ``grad_scaler_options=`` (GradScaler's keyword arguments, checked and
    completed with its defaults by constructing one; ``False``: no loss scaling)."""
    if precision not in PRECISIONS:
        raise InvalidOptionError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        if grad_scaler_options:
            raise InvalidOptionError("grad_scaler_options= is for mixed precision; give precision='fp16' or 'bf16'")
        return Precision()
    if grad_scaler_options is False:
        return Precision(precision, dtype)
    options = dict(grad_scaler_options) if isinstance(grad_scaler_options, Mapping) else {}
    unknown = sorted(set(options) - set(_SCALER_OPTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown grad_scaler_options {unknown}; valid options: {', '.join(_SCALER_OPTIONS)}")
    interval = options.get("growth_interval", 1)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise InvalidOptionError(f"grad_scaler_options growth_interval={interval!r}: give an integer >= 1")
    init_scale = options.get("init_scale", 1.0)
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not 0 < init_scale < float("inf"):
        raise InvalidOptionError(f"grad_scaler_options init_scale={init_scale!r}: give a positive finite number")
    try:  # GradScaler checks growth_factor > 1 and backoff_factor < 1
        torch.amp.GradScaler("cpu", **options)
    except (AssertionError, ValueError, TypeError) as exc:
        raise InvalidOptionError(f"grad_scaler_options {options}: {exc or 'invalid value'}") from exc
    defaults = {name: parameter.default for name, parameter in
                inspect.signature(torch.amp.GradScaler.__init__).parameters.items() if name in _SCALER_OPTIONS}
    return Precision(precision, dtype, {**defaults, **options})


@contextlib.contextmanager
def autocast(precision: Precision) -> Iterator[None]:
    """torch's CPU autocast in ``precision.dtype`` (nothing for float32)."""
    if precision.dtype is None:
        yield
        return
    with torch.autocast("cpu", dtype=precision.dtype):
        yield


def unscale(grads: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of the scaled loss times GradScaler's ``inv_scale`` (the float64 reciprocal of the
    scale, rounded to float32)."""
    inverse = torch.reciprocal(scale.to(torch.float64)).to(torch.float32)
    return [grad * inverse.to(grad.dtype) for grad in grads]


def found_nonfinite(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether any gradient holds a NaN or an infinity: ``sum(g * 0)`` is 0 for finite ``g`` and NaN
    otherwise, in any summation order."""
    total = sum((torch.sum(grad * 0).to(torch.float32) for grad in grads), torch.zeros((), dtype=torch.float32))
    return torch.isnan(total)


def keep_if(skipped: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` where the step is skipped, else ``new``."""
    return torch.where(skipped, old, new)


def update_scale(scale: torch.Tensor, tracker: torch.Tensor, skipped: torch.Tensor,
                 options: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """GradScaler's ``_amp_update_scale_``: backoff on a skipped step (tracker reset), growth (if finite) after
    ``growth_interval`` good steps in a row (tracker reset), else one more good step."""
    good = tracker + 1
    due = good >= float(options["growth_interval"])
    grown = scale * float(options["growth_factor"])
    grown = torch.where(due & ~torch.isinf(grown), grown, scale)
    new_scale = torch.where(skipped, scale * float(options["backoff_factor"]), grown)
    new_tracker = torch.where(skipped | due, torch.zeros_like(tracker), good)
    return new_scale, new_tracker
