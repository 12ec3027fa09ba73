"""Loss functions: a registry of names -> torch loss functions with torch's own options.

Each loss is the ``torch.nn.functional`` function of the same meaning, so its numerics and
options (``reduction``, ``label_smoothing``, ``weight``, ...) are torch's by construction;
the lowering stage turns the traced ops into explicit ONNX arithmetic (no
SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss, which onnx-mlir lacks).
``loss=`` may also be a ``torch.nn`` loss module (known types map to the named loss with the
module's settings) or any callable ``(output, target) -> scalar``.

The ``target`` input: class indices (int64) for ``ce``/``nll``, unless
``label_format="probabilities"`` (``ce`` only), which makes it a float tensor of the
output's shape; for every other loss and for callables, a float tensor of the output's
shape (``label_format="indices"`` gives a callable class indices instead).
For an output [N, T, V] with indices [N, T], ``ce``/``nll`` take the last dim as the classes
(the language-model convention); other ranks follow torch ([N, C] and [N, C, d...]).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InvalidOptionError

INDICES, PROBABILITIES = "indices", "probabilities"


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
    label_format: str

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(output, target, **self.options)

    def target_spec(self, output: torch.Tensor) -> TargetSpec:
        shape = tuple(output.shape)
        if self.label_format == PROBABILITIES:
            return TargetSpec(shape, output.dtype)
        if len(shape) == 3:  # [N, T, V] -> [N, T]
            return TargetSpec(shape[:2], torch.int64)
        return TargetSpec((shape[0],) + shape[2:] if len(shape) > 1 else (), torch.int64)

    def check(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Run the loss once eagerly, so a bad option value fails here with a clear message."""
        try:
            with torch.no_grad():
                value = self(output, target)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            raise InvalidOptionError(
                f"loss '{self.name}' with options {self.options} fails on the model output "
                f"{list(output.shape)} and target {list(target.shape)} ({target.dtype}): {exc}"
            ) from exc
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InvalidOptionError(f"loss '{self.name}' must return a scalar tensor, got {type(value).__name__}")


def _flatten_sequence(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T, V] output with [N, T] indices or [N, T, V] probabilities -> [N*T, V] rows."""
    if output.dim() == 3 and target.dim() in (2, 3):
        return output.reshape(-1, output.shape[-1]), target.reshape(-1, *target.shape[2:])
    return output, target


def _cross_entropy(output: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    output, target = _flatten_sequence(output, target)
    if options.get("label_smoothing", 0.0) and not target.is_floating_point():
        return _smoothed_cross_entropy(output, target, **options)
    return F.cross_entropy(output, target, **options)


def _smoothed_cross_entropy(output, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """torch's cross_entropy with label smoothing on class indices, term for term.

    torch's own composite counts the non-ignored targets as an int64 sum (an int -> float Cast
    in ONNX, which onnx-mlir lacks) and gathers the class weights; here both are float sums
    over one-hot masks.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise InvalidOptionError(f"loss 'ce': label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    classes = output.shape[1]
    log_probs = F.log_softmax(output, 1)
    nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)
    keep = target != ignore_index
    broadcast = [1] * output.dim()
    broadcast[1] = classes
    weighted = log_probs if weight is None else log_probs * weight.reshape(broadcast)
    smooth = torch.where(keep, -weighted.sum(1), 0.0).sum()
    if reduction == "mean":
        if weight is None:
            smooth = smooth / torch.where(keep, 1.0, 0.0).sum()
        else:
            one_hot = target.unsqueeze(1) == torch.arange(classes, device=target.device).reshape(broadcast)
            target_weight = torch.where(one_hot, weight.reshape(broadcast), 0.0).sum(1)
            smooth = smooth / torch.where(keep, target_weight, 0.0).sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / classes)


def _nll(output: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
    return F.nll_loss(*_flatten_sequence(output, target), **options)


@dataclass(frozen=True)
class _Entry:
    fn: Callable[..., torch.Tensor]
    signature: Callable  # whose keyword arguments are the options
    label_formats: tuple[str, ...] = (PROBABILITIES,)  # the first is the default
    module: type[torch.nn.Module] | None = None


_LOSSES: dict[str, _Entry] = {
    "mse": _Entry(F.mse_loss, F.mse_loss, module=torch.nn.MSELoss),
    "ce": _Entry(_cross_entropy, F.cross_entropy, (INDICES, PROBABILITIES), torch.nn.CrossEntropyLoss),
    "nll": _Entry(_nll, F.nll_loss, (INDICES,), torch.nn.NLLLoss),
    "bce_with_logits": _Entry(
        F.binary_cross_entropy_with_logits, F.binary_cross_entropy_with_logits, module=torch.nn.BCEWithLogitsLoss
    ),
    "bce": _Entry(F.binary_cross_entropy, F.binary_cross_entropy, module=torch.nn.BCELoss),
    "l1": _Entry(F.l1_loss, F.l1_loss, module=torch.nn.L1Loss),
    "smooth_l1": _Entry(F.smooth_l1_loss, F.smooth_l1_loss, module=torch.nn.SmoothL1Loss),
    "huber": _Entry(F.huber_loss, F.huber_loss, module=torch.nn.HuberLoss),
    "kl_div": _Entry(F.kl_div, F.kl_div, module=torch.nn.KLDivLoss),
}
_ALIASES = {
    "cross_entropy": "ce",
    "mse_loss": "mse",
    "nll_loss": "nll",
    "binary_cross_entropy_with_logits": "bce_with_logits",
    "binary_cross_entropy": "bce",
    "l1_loss": "l1",
    "smooth_l1_loss": "smooth_l1",
    "huber_loss": "huber",
}
_NOT_OPTIONS = {"input", "target", "size_average", "reduce"}
_REDUCTIONS = {"kl_div": ("mean", "sum", "batchmean")}


def _allowed_options(signature_source: Callable) -> set[str]:
    params = inspect.signature(signature_source).parameters
    return {name for name in params if name not in _NOT_OPTIONS}


def _label_format(name: str, options: dict, formats: tuple[str, ...]) -> str:
    label_format = options.pop("label_format", formats[0])
    if label_format not in formats:
        raise InvalidOptionError(
            f"loss '{name}': label_format={label_format!r} is not valid; valid: {', '.join(formats)}"
        )
    return label_format


def _callable_loss(loss: Callable, options: dict) -> Loss:
    label_format = _label_format("callable", options, (PROBABILITIES, INDICES))
    if options:
        raise InvalidOptionError(
            f"loss_options {sorted(options)} apply to named losses only (a callable loss takes "
            "only label_format); configure the callable itself"
        )
    name = type(loss).__name__ if isinstance(loss, torch.nn.Module) else getattr(loss, "__name__", "custom")
    return Loss(name, lambda out, tgt: loss(out, tgt), {}, label_format)


def _module_options(module: torch.nn.Module, entry: _Entry) -> dict[str, Any]:
    """The settings of a torch.nn loss module, as the functional loss's keyword arguments."""
    return {k: getattr(module, k) for k in _allowed_options(entry.signature) if hasattr(module, k)}


def make_loss(loss: str | Callable, options: dict[str, Any] | None = None) -> Loss:
    """Resolve ``loss=`` (a name, a torch loss module or a callable) to a ``Loss``."""
    options = dict(options or {})
    if callable(loss):
        known = [name for name, entry in _LOSSES.items() if entry.module is type(loss)]
        if not known:
            return _callable_loss(loss, options)
        unknown = sorted(set(options) - {"label_format"})
        if unknown:
            raise InvalidOptionError(
                f"loss_options {unknown} do not apply to a {type(loss).__name__} instance (only label_format); "
                "set them on the module"
            )
        key, options = known[0], {**_module_options(loss, _LOSSES[known[0]]), **options}
    else:
        key = _ALIASES.get(str(loss).lower(), str(loss).lower())
        if key not in _LOSSES:
            raise InvalidOptionError(f"unknown loss '{loss}'; valid losses: {', '.join(available_losses())}")
    entry = _LOSSES[key]
    label_format = _label_format(key, options, entry.label_formats)
    allowed = _allowed_options(entry.signature)
    unknown = sorted(set(options) - allowed)
    if unknown:
        valid = sorted(allowed | ({"label_format"} if len(entry.label_formats) > 1 else set()))
        raise InvalidOptionError(f"unknown option(s) {unknown} for loss '{key}'; valid options: {', '.join(valid)}")
    reductions = _REDUCTIONS.get(key, ("mean", "sum"))
    if options.get("reduction", "mean") not in reductions:
        raise InvalidOptionError(
            f"loss '{key}': reduction={options['reduction']!r} is not valid (the loss must be a scalar); "
            f"valid: {', '.join(reductions)}"
        )
    for name, value in options.items():
        if isinstance(value, (list, tuple)):
            options[name] = torch.tensor(value, dtype=torch.float32)
    return Loss(key, entry.fn, options, label_format)


def available_losses() -> list[str]:
    return sorted(_LOSSES)
