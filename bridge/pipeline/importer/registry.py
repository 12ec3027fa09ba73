"""Registry of ONNX-op converters: one torch function per ONNX op type.

A converter is registered with::

    @converter("Gemm")
    def gemm(ctx: NodeContext, a, b, c=None): ...

It receives the node's inputs in order (``None`` for an absent optional input) and returns
a tensor or a tuple of tensors, one per node output. Inputs listed in ``static=`` must be
known at import time (shapes, axes, pads, scales): the converter receives them as numpy
arrays and the interpreter raises a clear error if they are computed from data.
Converters read attributes with ``ctx.attr(name, default)``; they handle every opset in
which the op exists (``ctx.opset``), e.g. axes as an attribute before opset 13 and as an
input from 13 on.

An op of another domain is registered with ``domain=`` and keyed ``<domain>::<OpType>``
(``op_key``). ``attribute_weights=`` names float-list attributes that hold an op's weights
(ai.onnx.ml keeps a linear model's coefficients there): the importer lifts each into the
initializer ``<node>.<attribute>`` (``OnnxProgram``), passed after the node's own inputs, so it
trains like any initializer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx
import torch

from ...attributes import attribute
from ...errors import UnsupportedOpError
from ..registry import import_submodules, register


class ConverterFn(Protocol):
    """A converter: the node's context and its inputs in order (``None`` for an absent optional
    one; numpy for ``static=`` inputs) -> a tensor, or a tuple of them, one per node output."""

    def __call__(self, ctx: NodeContext, *inputs: Any) -> Any: ...


@dataclass(frozen=True)
class Converter:
    op_type: str
    fn: ConverterFn
    static: tuple[int, ...] = ()
    buffers: tuple[int, ...] = ()  # inputs that are running statistics (updated, not trained)
    raw: bool = False  # inputs as they are (numpy or tensor, never folded as a whole): control flow
    attribute_weights: tuple[str, ...] = ()  # float-list attributes lifted to initializers (module doc)


CONVERTERS: dict[str, Converter] = {}
DEFAULT_DOMAINS = ("", "ai.onnx")


def op_key(domain: str, op_type: str) -> str:
    """The registry key of an op: its type in the default domain, ``<domain>::<OpType>`` in another."""
    return op_type if domain in DEFAULT_DOMAINS else f"{domain}::{op_type}"


def converter(*op_types: str, static: tuple[int, ...] = (), buffers: tuple[int, ...] = (), raw: bool = False,
              domain: str = "", attribute_weights: tuple[str, ...] = ()):
    """Register ``fn`` as the converter of each ONNX op type in ``op_types`` of ``domain`` (``raw``: it
    receives values known before the model runs as numpy and values computed from data as tensors, and
    the node is never folded as a whole: for ops whose subgraphs read outer-scope values;
    ``attribute_weights``: see the module doc)."""

    def add(fn: ConverterFn) -> ConverterFn:
        for op_type in op_types:
            key = op_key(domain, op_type)
            register(CONVERTERS, key, Converter(key, fn, static, buffers, raw, attribute_weights),
                     "converters for ONNX op")
        return fn

    return add


@dataclass
class NodeContext:
    """What a converter may know about the node it converts."""

    node: onnx.NodeProto
    opset: int
    training: bool
    updated_buffers: dict[str, Any] = field(default_factory=dict)
    random_inputs: dict[str, Any] = field(default_factory=dict)
    evaluation: bool = False  # bridge's eval graph: inference as torch's eval(), whatever the node's own mode
    # Evaluates a subgraph attribute with its inputs bound (``{name: value}``) in this node's scope:
    # returns the subgraph's outputs (see ``OnnxProgram._evaluate``).
    run_graph: Callable[[onnx.GraphProto, dict], list] | None = None
    frozen_batch_norm: bool = False  # BatchNorm trains with its running statistics, fixed (torch's BatchNorm eval())

    @property
    def name(self) -> str:
        return self.node.name

    def attr(self, name: str, default: Any = None) -> Any:
        """The node's attribute ``name`` decoded (``bridge.attributes.attribute``), or ``default``."""
        return attribute(self.node, name, default)

    def has_attr(self, name: str) -> bool:
        return any(a.name == name for a in self.node.attribute)

    def input_name(self, index: int) -> str:
        return self.node.input[index] if index < len(self.node.input) else ""

    def update_buffer(self, input_index: int, value) -> None:
        """Record the new value of a buffer input (e.g. BatchNorm running mean)."""
        self.updated_buffers[self.input_name(input_index)] = value

    def random_uniform(self, like) -> Any:
        """Uniform [0, 1) noise shaped like ``like``: the graph input ``<node name>.noise``.

        Randomness enters the training graph as an input, since a compiled random op repeats its
        seed every step. ``random_inputs`` holds the value when the caller provides one (the
        traced step), else a fresh draw is recorded there (so a dry run lists the inputs).
        """
        name = f"{self.name}.noise"
        if name not in self.random_inputs:
            self.random_inputs[name] = torch.rand(like.shape, dtype=like.dtype)
        return self.random_inputs[name]

    def unsupported(self, what: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{self.node.op_type} node '{self.name}': {what} is not supported")

    def ints(self, value) -> list[int]:
        """A static input or attribute as a list of Python ints (``torch.SymInt`` kept as is)."""
        return [v if isinstance(v, torch.SymInt) else int(v) for v in np.asarray(value).reshape(-1)]


def buffer_inputs() -> dict[str, tuple[int, ...]]:
    """``{op type: its running-statistic inputs}`` of every converter with ``buffers=``, for
    ``bridge.pipeline.load.load_model`` (which reads models without importing the converters)."""
    import_all_converters()
    return {op_type: c.buffers for op_type, c in CONVERTERS.items() if c.buffers}


def import_all_converters() -> None:
    """Import every module of ``bridge.pipeline.importer.ops`` so that their converters register."""
    import_submodules(f"{__package__}.ops")
