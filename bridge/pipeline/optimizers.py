"""Optimizers: functional update rules that reproduce ``torch.optim`` step for step.

Each rule is torch.optim's single-tensor algorithm (``torch/optim/<name>.py``, the path
torch takes on CPU) written as a pure function of (param, grad, state, step, lr), so it can
be traced into the training graph with ``lr`` and ``step`` as live graph inputs. torch
computes every step-dependent scalar (bias corrections, RAdam's rectification, NAdam's
momentum schedule, Adagrad's decayed lr) in Python floats, i.e. float64; the rules do the
same in float64 tensor ops and round once to the parameter's dtype, because in float32
``1 - beta ** step`` cancels badly. State slots use torch.optim's state keys and are
initialised as torch.optim initialises them. Options are validated by constructing the
torch optimizer itself, so defaults and error messages match torch.
See docs/losses_and_optimizers.md for why the rules are re-implemented, not traced.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import InvalidOptionError

State = dict[str, torch.Tensor]


def _zeros(slot: str, param: torch.Tensor, options: dict) -> torch.Tensor:
    """``torch.zeros_like(param)``; for a contiguous ``param`` (the weights are) numpy's calloc'ed zeros of the
    unsigned type of its width viewed as its dtype (numpy has no bfloat16), which the OS zero-fills page by page on
    first touch: ``zeros_like`` would write every byte of state that the trace never reads (it runs on fake
    tensors)."""
    if not param.is_contiguous() or not param.numel():  # zeros_like keeps their strides
        return torch.zeros_like(param)
    return torch.from_numpy(np.zeros(param.numel(), f"u{param.element_size()}")).view(param.dtype).view(param.shape)


@dataclass(frozen=True)
class Rule:
    torch_class: type[torch.optim.Optimizer]
    slots: Callable[[dict], list[str]]
    update: Callable[..., tuple[torch.Tensor, State]]
    initial: Callable[[str, torch.Tensor, dict], torch.Tensor] = _zeros


@dataclass(frozen=True)
class Optimizer:
    """A configured optimizer: its rule and its complete option set (torch defaults filled in)."""

    name: str
    rule: Rule
    options: dict[str, Any]

    @property
    def lr(self) -> float:
        return float(self.options["lr"])

    def slots(self) -> list[str]:
        return self.rule.slots(self.options)

    def initial_state(self, param: torch.Tensor) -> State:
        return {slot: self.rule.initial(slot, param, self.options) for slot in self.slots()}

    def update(self, param, grad, state: State, step, lr) -> tuple[torch.Tensor, State]:
        """One step for one tensor; ``step`` is the already incremented step count."""
        options = {k: v for k, v in self.options.items() if k != "lr"}
        return self.rule.update(param, grad, dict(state), step, lr, **options)


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``torch.lerp`` with a Python weight: torch's two formulas, the branch picked while tracing."""
    if abs(weight) < 0.5:
        return start + weight * (end - start)
    return end - (end - start) * (1 - weight)


def _direction(grad: torch.Tensor, maximize: bool) -> torch.Tensor:
    return -grad if maximize else grad


def _weight_decay(p, g, lr, weight_decay, decoupled=False):
    """L2 penalty added to the gradient, or (decoupled, AdamW-style) a shrink of the parameter."""
    if not weight_decay:
        return p, g
    if decoupled:
        return p * (1 - _f64(lr) * weight_decay).to(p.dtype), g
    return p, g + weight_decay * p


def _sgd(p, g, s, step, lr, momentum, dampening, weight_decay, nesterov, maximize, **_):
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay)
    if momentum:
        # torch starts the buffer at the first gradient (step 1), then decays it. Without dampening
        # the decayed zero initial buffer is that gradient (0 + g == g): no select, no scaling by 1.
        if dampening:
            buf = torch.where(step <= 1, g, momentum * s["momentum_buffer"] + (1 - dampening) * g)
        else:
            buf = momentum * s["momentum_buffer"] + g
        s["momentum_buffer"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, s


def _adam(p, g, s, step, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, **_):
    beta1, beta2 = betas
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay, decoupled_weight_decay)
    s["exp_avg"] = _lerp(s["exp_avg"], g, 1 - beta1)
    s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    step64 = _f64(step)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, step64))
    # torch: p + (-step_size * exp_avg) / (sqrt(second) / bias_correction2_sqrt + eps); numerator and
    # denominator multiplied by bias_correction2_sqrt in the per-step float64 scalars, so each weight
    # takes one full-size pass fewer (5 instead of 6).
    scaled_step = (-_f64(lr) / (1 - torch.pow(beta1, step64)) * bias_correction2_sqrt).to(p.dtype)
    scaled_eps = (eps * bias_correction2_sqrt).to(p.dtype)
    second = s["exp_avg_sq"]
    if amsgrad:
        s["max_exp_avg_sq"] = torch.maximum(s["max_exp_avg_sq"], s["exp_avg_sq"])
        second = s["max_exp_avg_sq"]
    return p + scaled_step * s["exp_avg"] / (torch.sqrt(second) + scaled_eps), s


def _rmsprop(p, g, s, step, lr, alpha, eps, weight_decay, momentum, centered, maximize, **_):
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay)
    s["square_avg"] = s["square_avg"] * alpha + (1 - alpha) * g * g
    if centered:
        s["grad_avg"] = _lerp(s["grad_avg"], g, 1 - alpha)
        avg = torch.sqrt(s["square_avg"] - s["grad_avg"] * s["grad_avg"]) + eps
    else:
        avg = torch.sqrt(s["square_avg"]) + eps
    if momentum > 0:
        s["momentum_buffer"] = s["momentum_buffer"] * momentum + g / avg
        return p - lr * s["momentum_buffer"], s
    return p + -lr * g / avg, s  # torch's addcdiv: (-lr * grad) / avg, then added


def _adagrad(p, g, s, step, lr, lr_decay, weight_decay, eps, maximize, **_):
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay)
    clr = (_f64(lr) / (1 + (_f64(step) - 1) * lr_decay)).to(p.dtype)
    s["sum"] = s["sum"] + g * g
    return p - clr * (g / (torch.sqrt(s["sum"]) + eps)), s


def _adadelta(p, g, s, step, lr, rho, eps, weight_decay, maximize, **_):
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay)
    s["square_avg"] = s["square_avg"] * rho + (1 - rho) * g * g
    std = torch.sqrt(s["square_avg"] + eps)
    delta = torch.sqrt(s["acc_delta"] + eps) / std * g
    s["acc_delta"] = s["acc_delta"] * rho + (1 - rho) * delta * delta
    return p - lr * delta, s


def _adamax(p, g, s, step, lr, betas, eps, weight_decay, maximize, **_):
    beta1, beta2 = betas
    g = _direction(g, maximize)
    p, g = _weight_decay(p, g, lr, weight_decay)
    s["exp_avg"] = _lerp(s["exp_avg"], g, 1 - beta1)
    s["exp_inf"] = torch.maximum(s["exp_inf"] * beta2, torch.abs(g) + eps)
    clr = (_f64(lr) / (1 - torch.pow(beta1, _f64(step)))).to(p.dtype)
    return p - clr * (s["exp_avg"] / s["exp_inf"]), s


def _nadam(p, g, s, step, lr, betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize, **_):
    beta1, beta2 = betas
    g = _direction(g, maximize)
    step64, lr64 = _f64(step), _f64(lr)
    p, g = _weight_decay(p, g, lr, weight_decay, decoupled_weight_decay)
    bias_correction2 = 1 - torch.pow(beta2, step64)
    mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step64 * momentum_decay))
    mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step64 + 1) * momentum_decay))
    # torch keeps mu_product as a float32 tensor and reads it back as a Python float.
    s["mu_product"] = s["mu_product"] * mu.to(s["mu_product"].dtype)
    mu_product = _f64(s["mu_product"])
    s["exp_avg"] = _lerp(s["exp_avg"], g, 1 - beta1)
    s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    denom = torch.sqrt(s["exp_avg_sq"] / bias_correction2.to(p.dtype)) + eps
    grad_coef = (-lr64 * (1.0 - mu) / (1.0 - mu_product)).to(p.dtype)
    avg_coef = (-lr64 * mu_next / (1.0 - mu_product * mu_next)).to(p.dtype)
    p = p + grad_coef * (g / denom)
    return p + avg_coef * (s["exp_avg"] / denom), s


def _radam(p, g, s, step, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize, **_):
    beta1, beta2 = betas
    g = _direction(g, maximize)
    step64 = _f64(step)
    p, g = _weight_decay(p, g, lr, weight_decay, decoupled_weight_decay)
    s["exp_avg"] = _lerp(s["exp_avg"], g, 1 - beta1)
    s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    bias_correction1 = 1 - torch.pow(beta1, step64)
    bias_correction2 = 1 - torch.pow(beta2, step64)
    corrected = s["exp_avg"] / bias_correction1.to(p.dtype)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step64 * torch.pow(beta2, step64) / bias_correction2
    # The rectified update applies once the variance is tractable (rho_t > 5); the clamp only
    # keeps the unused branch finite before that.
    rect = torch.sqrt(torch.clamp((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t), min=0))
    adaptive = torch.sqrt(bias_correction2).to(p.dtype) / (torch.sqrt(s["exp_avg_sq"]) + eps)
    plain = corrected * lr
    update = torch.where(rho_t > 5.0, plain * adaptive * rect.to(p.dtype), plain)
    return p - update, s


def _adam_slots(options: dict) -> list[str]:
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if options["amsgrad"] else [])


def _rmsprop_slots(options: dict) -> list[str]:
    return (
        ["square_avg"]
        + (["momentum_buffer"] if options["momentum"] > 0 else [])
        + (["grad_avg"] if options["centered"] else [])
    )


def _adagrad_initial(slot: str, param: torch.Tensor, options: dict) -> torch.Tensor:
    return torch.full_like(param, options["initial_accumulator_value"])


def _nadam_initial(slot: str, param: torch.Tensor, options: dict) -> torch.Tensor:
    return torch.ones((), dtype=param.dtype) if slot == "mu_product" else _zeros(slot, param, options)


RULES: dict[str, Rule] = {
    "sgd": Rule(torch.optim.SGD, lambda o: ["momentum_buffer"] if o["momentum"] else [], _sgd),
    "adam": Rule(torch.optim.Adam, _adam_slots, _adam),
    "adamw": Rule(torch.optim.AdamW, _adam_slots, _adam),
    "rmsprop": Rule(torch.optim.RMSprop, _rmsprop_slots, _rmsprop),
    "adagrad": Rule(torch.optim.Adagrad, lambda o: ["sum"], _adagrad, _adagrad_initial),
    "adadelta": Rule(torch.optim.Adadelta, lambda o: ["square_avg", "acc_delta"], _adadelta),
    "adamax": Rule(torch.optim.Adamax, lambda o: ["exp_avg", "exp_inf"], _adamax),
    "nadam": Rule(torch.optim.NAdam, lambda o: ["mu_product", "exp_avg", "exp_avg_sq"], _nadam, _nadam_initial),
    "radam": Rule(torch.optim.RAdam, lambda o: ["exp_avg", "exp_avg_sq"], _radam),
}

# Options of torch.optim constructors that change how torch runs, not what it computes.
_IMPLEMENTATION_OPTIONS = {"foreach", "capturable", "differentiable", "fused"}


def _rule_name(optim: str | type[torch.optim.Optimizer]) -> str:
    if isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer):
        for name, rule in RULES.items():
            if rule.torch_class is optim:
                return name
        raise InvalidOptionError(
            f"optimizer class {optim.__name__} has no bridge rule; supported: "
            + ", ".join(rule.torch_class.__name__ for rule in RULES.values())
        )
    name = str(optim).lower()
    if name not in RULES:
        raise InvalidOptionError(f"unknown optimizer '{optim}'; valid optimizers: {', '.join(sorted(RULES))}")
    return name


def make_optimizer(optim: str | type[torch.optim.Optimizer], options: dict[str, Any] | None = None) -> Optimizer:
    """Resolve ``optim=`` (a name or a torch.optim class) and validate its options with torch."""
    options = dict(options or {})
    name = _rule_name(optim)
    rule = RULES[name]
    allowed = [p for p in inspect.signature(rule.torch_class.__init__).parameters if p not in ("self", "params")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidOptionError(
            f"unknown option(s) {unknown} for optimizer '{name}'; valid options: {', '.join(allowed)}"
        )
    _check_finite(name, options)
    try:
        probe = rule.torch_class([torch.zeros(1, requires_grad=True)], **options)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidOptionError(
            f"optimizer '{name}': invalid option value ({exc}); options given: {options}"
        ) from exc
    defaults = {k: v for k, v in probe.defaults.items() if k not in _IMPLEMENTATION_OPTIONS}
    if isinstance(defaults.get("lr"), torch.Tensor):
        defaults["lr"] = float(defaults["lr"])
    return Optimizer(name, rule, defaults)


def _check_finite(name: str, options: dict[str, Any]) -> None:
    """Every number among ``options`` (tuples such as ``betas`` included) must be finite: torch.optim
    accepts ``lr=nan``/``inf`` or ``momentum=nan``, and the weights become NaN at the first step."""
    for key, value in options.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        for item in values:
            number = float(item) if isinstance(item, torch.Tensor) and item.numel() == 1 else item
            if isinstance(number, float) and not math.isfinite(number):
                raise InvalidOptionError(f"optimizer '{name}': {key}={value!r} is not finite; give a finite number")


def clip_grad_norm(grads: Sequence[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """Scale ``grads`` so their global L2 norm is at most ``max_norm``.

    The arithmetic of ``torch.nn.utils.clip_grad_norm_(foreach=False)``: the norm of the
    per-tensor norms, ``clip_coef = max_norm / (total_norm + 1e-6)`` clamped to 1, and every
    gradient multiplied by it (also when it is 1).
    """
    norms = torch.stack([torch.sqrt(torch.sum(g * g)) for g in grads])
    total_norm = torch.sqrt(torch.sum(norms * norms))
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    return [g * coef.to(g.dtype) for g in grads]


def available_optimizers() -> list[str]:
    return sorted(RULES)


def check_max_norm(max_norm: float | None) -> float | None:
    """Validate ``clip_grad_norm=`` (a positive finite number, or None for no clipping)."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0 < max_norm < float("inf"):
        raise InvalidOptionError(f"clip_grad_norm={max_norm!r} is not valid; give a positive finite max norm or None")
    return float(max_norm)
