"""Which initializers are trained: the differentiable ones, narrowed by ``trainable=``/``frozen=``."""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from ...errors import BridgeError, InvalidOptionError
from ..replay import BlockLayouts, active_fake_mode, fake_of
from .program import OnnxProgram


@dataclass
class ExampleRun:
    """What one training-mode run of the model on example inputs shows (``example_run``)."""

    differentiable: list[str]  # the floating-point initializers the chosen output depends on differentiably
    output: torch.Tensor  # the chosen output (detached)
    buffers: list[str]  # the running statistics the training forward updates
    random: dict[str, torch.Tensor]  # the noise inputs (``<node>.noise``) its random ops read, with example values


def example_run(program: OnnxProgram, inputs: dict[str, torch.Tensor], output_index: int) -> ExampleRun:
    """Run the graph once eagerly in training mode, every candidate weight requiring grad.

    An initializer used only as a shape, scale or index gets no gradient and stays a constant. The autograd
    graph of the output is walked rather than differentiated (no gradient is computed: a 100M-parameter model
    would allocate its weights' size again). On fake tensors, repeated blocks run until their layouts are known
    (``BlockLayouts``).
    """
    candidates = program.floating_initializers()
    tensors = {name: _example_tensor(program, name) for name in candidates + program.buffer_names}
    for name in candidates:
        tensors[name].requires_grad_(True)
    random: dict[str, torch.Tensor] = {}
    outputs, updated = program.run(inputs, tensors, training=True, random=random,
                                   blocks=BlockLayouts() if active_fake_mode() is not None else None)
    output = outputs[output_index]
    if not output.dtype.is_floating_point:
        raise BridgeError(
            f"model output '{program.output_names[output_index]}' has dtype {output.dtype}; "
            "the loss needs a floating-point output (pick another with output=)"
        )
    reached = _leaves(output) if output.requires_grad else set()
    return ExampleRun([name for name in candidates if id(tensors[name]) in reached], output.detach(),
                      [name for name in program.buffer_names if name in updated], random)


def _example_tensor(program: OnnxProgram, name: str) -> torch.Tensor:
    """Initializer ``name`` as a tensor; in a fake mode (``bridge.api``'s probe), made outside it and then as a fake
    of its layout (``fake_of``): a tensor made inside the mode is lifted into it, at several times the cost. A
    one-element tensor is still lifted: the mode keeps such a value, which a converter may read."""
    fake_mode = active_fake_mode()
    if not isinstance(fake_mode, FakeTensorMode) or program.initializers[name].size <= 1:
        return program.initializer_tensor(name)
    with unset_fake_temporarily():
        tensor = program.initializer_tensor(name)
    return fake_of(fake_mode, tensor)


def differentiable_initializers(
    program: OnnxProgram, inputs: dict[str, torch.Tensor], output_index: int
) -> list[str]:
    """Floating-point initializers that the chosen output depends on differentiably (``example_run``)."""
    return example_run(program, inputs, output_index).differentiable


def _leaves(output: torch.Tensor) -> set[int]:
    """``id`` of every leaf tensor that ``output``'s autograd graph accumulates a gradient into; ``output``
    itself where it is such a leaf (a graph whose output is a weight: Sum or Max of one input, Clip
    without bounds, ReduceSum with no axes and ``noop_with_empty_axes``)."""
    if output.grad_fn is None:
        return {id(output)}
    return {id(fn.variable) for fn in autograd_nodes(output) if hasattr(fn, "variable")}  # AccumulateGrad


def autograd_nodes(root: torch.Tensor) -> Iterator:
    """Every node of ``root``'s autograd graph (``grad_fn`` and what it leads to), once each."""
    seen, stack = set(), [root.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        yield fn
        stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _matches(patterns: Iterable[str], names: list[str], argument: str, known: Iterable[str] = ()) -> set[str]:
    """The ``names`` that ``patterns`` match; a pattern matching none of them (nor of ``known``) is refused."""
    chosen: set[str] = set()
    known = list(known)
    for pattern in patterns:
        hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not hits and not any(fnmatch.fnmatchcase(n, pattern) for n in known):
            raise InvalidOptionError(
                f"{argument} pattern '{pattern}' matches no trainable weight; weights: {', '.join(names)}"
            )
        chosen |= hits
    return chosen


def select_trainable(
    candidates: list[str],
    trainable: Iterable[str] | str | None,
    frozen: Iterable[str] | str | None,
    scalars: Iterable[str] = (),
    initializers: Iterable[str] = (),
) -> list[str]:
    """Apply ``trainable=`` (keep only these) and ``frozen=`` (drop these); order is preserved.

    Without ``trainable=``, 0-d ``scalars`` are not trained: exporters make them from constants
    (the dynamo exporter's optimizer turns Gelu's 0.5 and sqrt(2), a mask's zeros into 0-d
    initializers), and torch parameters are never 0-d in practice; ``trainable=`` can name them.
    """
    if isinstance(trainable, str):
        trainable = [trainable]
    if isinstance(frozen, str):
        frozen = [frozen]
    keep = set(candidates) - set(scalars) if trainable is None else _matches(trainable, candidates, "trainable=")
    drop = set() if frozen is None else _matches(frozen, candidates, "frozen=", initializers)
    return [name for name in candidates if name in keep and name not in drop]
