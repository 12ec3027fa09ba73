"""Loss functions: a registry of names -> torch loss functions with torch's own options.

Each loss is the ``torch.nn.functional`` function of the same meaning, so its numerics and
options (``reduction``, ``label_smoothing``, ``weight``, ...) are torch's by construction;
the lowering stage turns the traced ops into explicit ONNX arithmetic (no
SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss, which onnx-mlir lacks).
``loss=`` may also be a ``torch.nn`` loss module or any callable ``(output, target) -> scalar``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import InvalidOptionError


@dataclass(frozen=True)
class TargetSpec:
    """Shape and dtype of the ``target`` input for a given model output."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Loss:
    name: str
    fn: Callable[..., torch.Tensor]
    options: dict[str, Any]
    target: Callable[[torch.Size, torch.dtype, dict], TargetSpec]

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(output, target, **self.options)

    def target_spec(self, output: torch.Tensor) -> TargetSpec:
        return self.target(output.shape, output.dtype, self.options)


def _same_as_output(shape, dtype, options) -> TargetSpec:
    return TargetSpec(tuple(shape), dtype)


def _class_indices(shape, dtype, options) -> TargetSpec:
    """[N, C] -> [N]; [N, T, V] -> [N, T] (language-model convention); [N, C, d...] -> [N, d...]."""
    if len(shape) == 3:
        return TargetSpec(tuple(shape[:2]), torch.int64)
    return TargetSpec((shape[0],) + tuple(shape[2:]), torch.int64)


def _cross_entropy(output: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    if output.dim() == 3 and target.dim() == 2:
        output = output.reshape(-1, output.shape[-1])
        target = target.reshape(-1)
    return F.cross_entropy(output, target, **options)


# name -> (function, signature source for options, target spec)
_LOSSES: dict[str, tuple[Callable, Callable, Callable]] = {
    "mse": (F.mse_loss, F.mse_loss, _same_as_output),
    "ce": (_cross_entropy, F.cross_entropy, _class_indices),
}
_ALIASES = {"cross_entropy": "ce", "mse_loss": "mse"}

_NOT_OPTIONS = {"input", "target", "size_average", "reduce"}


def _allowed_options(signature_source: Callable) -> set[str]:
    params = inspect.signature(signature_source).parameters
    return {name for name in params if name not in _NOT_OPTIONS}


def make_loss(loss: str | Callable, options: dict[str, Any] | None = None) -> Loss:
    """Resolve ``loss=`` (a name, a torch loss module or a callable) to a ``Loss``."""
    options = dict(options or {})
    if callable(loss):
        if options:
            raise InvalidOptionError("loss_options= applies to named losses only; configure the callable itself")
        name = type(loss).__name__ if isinstance(loss, torch.nn.Module) else getattr(loss, "__name__", "custom")
        return Loss(name, lambda out, tgt: loss(out, tgt), {}, _same_as_output)
    key = _ALIASES.get(str(loss).lower(), str(loss).lower())
    if key not in _LOSSES:
        raise InvalidOptionError(f"unknown loss '{loss}'; valid losses: {', '.join(sorted(_LOSSES))}")
    fn, signature_source, target = _LOSSES[key]
    allowed = _allowed_options(signature_source)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise InvalidOptionError(
            f"unknown option(s) {unknown} for loss '{key}'; valid options: {', '.join(sorted(allowed))}"
        )
    if options.get("reduction", "mean") not in ("mean", "sum"):
        raise InvalidOptionError(f"loss '{key}': reduction must be 'mean' or 'sum', not {options['reduction']!r}")
    for name, value in options.items():
        if isinstance(value, (list, tuple)):
            options[name] = torch.tensor(value, dtype=torch.float32)
    return Loss(key, fn, options, target)


def available_losses() -> list[str]:
    return sorted(_LOSSES)
