"""bridge vs a torch module over several training steps (one copy of the module-twin pattern).

The twin of an exported ``torch.nn.Module`` is the module itself, called through
``torch.func.functional_call`` with its parameters (named as the export names its
initializers) and the batch's data inputs; ``reference.torch_steps`` runs it under the real
``torch.optim`` optimizer.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

import bridge
from helpers.reference import Batch, assert_steps_match, bridge_steps, torch_steps


def module_weights(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters as numpy arrays (copies), by torch name."""
    return {name: p.detach().numpy().copy() for name, p in module.named_parameters()}


def module_twin(module: torch.nn.Module, inputs: Sequence[str] = ("x",)) -> Callable:
    """``forward(params, batch_inputs)``: ``module`` with ``params``, called with ``inputs`` in order."""
    def forward(params, batch_inputs):
        return torch.func.functional_call(module, params, tuple(batch_inputs[name] for name in inputs))

    return forward


def module_steps(module: torch.nn.Module, batches: Sequence[Batch], loss_fn: Callable, optimizer: type,
                 options: Mapping, inputs: Sequence[str] = ("x",), **kwargs) -> list[dict]:
    """``reference.torch_steps`` of ``module`` itself (``kwargs``: ``lr_schedule``, ``max_grad_norm``)."""
    return torch_steps(module_twin(module, inputs), module_weights(module), loss_fn, optimizer, options, batches,
                       **kwargs)


def assert_trains_like(tm: bridge.TrainingModel, module: torch.nn.Module, batches: Sequence[Batch],
                       loss_fn: Callable, optimizer: type, options: Mapping, rtol: float = 1e-5,
                       inputs: Sequence[str] = ("x",)) -> None:
    """Every step of ``tm`` in onnxruntime (loss, gradients, updated weights) matches ``module``
    trained by ``optimizer`` on the same ``batches``."""
    want = module_steps(module, batches, loss_fn, optimizer, options, inputs)
    assert_steps_match(bridge_steps(tm, batches), want, rtol=rtol)
