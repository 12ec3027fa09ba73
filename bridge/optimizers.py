"""Optimizers: functional update rules that reproduce ``torch.optim`` step for step.

Each rule is torch.optim's single-tensor algorithm (``torch/optim/<name>.py``) written as a
pure function of (param, grad, state, step, lr), so it can be traced into the training graph
with ``lr`` and ``step`` as live graph inputs. State slots use torch.optim's state keys and
are initialised as torch.optim initialises them. Options are validated by constructing the
torch optimizer itself, so defaults and error messages match torch.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import InvalidOptionError

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    torch_class: type[torch.optim.Optimizer]
    slots: Callable[[dict], list[str]]
    update: Callable[..., tuple[torch.Tensor, State]]
    initial: Callable[[str, torch.Tensor, dict], torch.Tensor] = lambda slot, p, o: torch.zeros_like(p)


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


def _sgd(p, g, s, step, lr, momentum, dampening, weight_decay, nesterov, maximize, **_):
    if maximize:
        g = -g
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        # torch starts the buffer at the first gradient (step 1), then decays it.
        first = step <= 1
        buf = torch.where(first, g, momentum * s["momentum_buffer"] + (1 - dampening) * g)
        s["momentum_buffer"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, s


def _adam(p, g, s, step, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False, **_):
    beta1, beta2 = betas
    if maximize:
        g = -g
    if weight_decay:
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    s["exp_avg"] = s["exp_avg"] + (1 - beta1) * (g - s["exp_avg"])
    s["exp_avg_sq"] = s["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
    # torch computes the bias corrections in Python floats (double): 1 - beta**step cancels
    # badly in float32, so they are computed in float64 here too, then rounded once.
    step64 = step.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, step64)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, step64)).to(p.dtype)
    step_size = (lr.to(torch.float64) / bias_correction1).to(p.dtype)
    second = s["exp_avg_sq"]
    if amsgrad:
        s["max_exp_avg_sq"] = torch.maximum(s["max_exp_avg_sq"], s["exp_avg_sq"])
        second = s["max_exp_avg_sq"]
    denom = torch.sqrt(second) / bias_correction2_sqrt + eps
    return p - step_size * (s["exp_avg"] / denom), s


def _adamw(p, g, s, step, lr, **options):
    return _adam(p, g, s, step, lr, decoupled=True, **options)


def _rmsprop(p, g, s, step, lr, alpha, eps, weight_decay, momentum, centered, maximize, **_):
    if maximize:
        g = -g
    if weight_decay:
        g = g + weight_decay * p
    s["square_avg"] = s["square_avg"] * alpha + (1 - alpha) * g * g
    if centered:
        s["grad_avg"] = s["grad_avg"] + (1 - alpha) * (g - s["grad_avg"])
        avg = torch.sqrt(s["square_avg"] - s["grad_avg"] * s["grad_avg"]) + eps
    else:
        avg = torch.sqrt(s["square_avg"]) + eps
    if momentum > 0:
        s["momentum_buffer"] = s["momentum_buffer"] * momentum + g / avg
        return p - lr * s["momentum_buffer"], s
    return p - lr * (g / avg), s


def _adagrad(p, g, s, step, lr, lr_decay, weight_decay, eps, maximize, **_):
    if maximize:
        g = -g
    if weight_decay:
        g = g + weight_decay * p
    clr = lr / (1 + (step - 1) * lr_decay)
    s["sum"] = s["sum"] + g * g
    return p - clr * (g / (torch.sqrt(s["sum"]) + eps)), s


RULES: dict[str, Rule] = {
    "sgd": Rule(torch.optim.SGD, lambda o: ["momentum_buffer"] if o["momentum"] else [], _sgd),
    "adam": Rule(torch.optim.Adam, lambda o: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o["amsgrad"] else []), _adam),
    "adamw": Rule(torch.optim.AdamW, lambda o: ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if o["amsgrad"] else []), _adamw),
    "rmsprop": Rule(
        torch.optim.RMSprop,
        lambda o: ["square_avg"] + (["momentum_buffer"] if o["momentum"] > 0 else []) + (["grad_avg"] if o["centered"] else []),
        _rmsprop,
    ),
    "adagrad": Rule(
        torch.optim.Adagrad,
        lambda o: ["sum"],
        _adagrad,
        initial=lambda slot, p, o: torch.full_like(p, o["initial_accumulator_value"]),
    ),
}

# Options of torch.optim constructors that change how torch runs, not what it computes.
_IMPLEMENTATION_OPTIONS = {"foreach", "capturable", "differentiable", "fused"}


def make_optimizer(optim: str | type[torch.optim.Optimizer], options: dict[str, Any] | None = None) -> Optimizer:
    """Resolve ``optim=`` (a name or a torch.optim class) and validate its options with torch."""
    options = dict(options or {})
    if isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer):
        matches = [name for name, rule in RULES.items() if rule.torch_class is optim]
        if not matches:
            raise InvalidOptionError(
                f"optimizer class {optim.__name__} has no bridge rule; supported: "
                + ", ".join(rule.torch_class.__name__ for rule in RULES.values())
            )
        name = matches[0]
    else:
        name = str(optim).lower()
    if name not in RULES:
        raise InvalidOptionError(f"unknown optimizer '{optim}'; valid optimizers: {', '.join(sorted(RULES))}")
    rule = RULES[name]
    allowed = [p for p in inspect.signature(rule.torch_class.__init__).parameters if p not in ("self", "params")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidOptionError(
            f"unknown option(s) {unknown} for optimizer '{name}'; valid options: {', '.join(allowed)}"
        )
    try:
        probe = rule.torch_class([torch.zeros(1, requires_grad=True)], **options)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidOptionError(f"optimizer '{name}': invalid option value: {exc}") from exc
    defaults = {k: v for k, v in probe.defaults.items() if k not in _IMPLEMENTATION_OPTIONS}
    if isinstance(defaults.get("lr"), torch.Tensor):
        defaults["lr"] = float(defaults["lr"])
    return Optimizer(name, rule, defaults)


def available_optimizers() -> list[str]:
    return sorted(RULES)
