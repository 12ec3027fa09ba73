"""Read a training graph as a program: roles, phases, layers, producers and consumers.

Everything here is read from the ONNX file's own annotations (``bridge.phase``,
``bridge.layer``, ``bridge.kind`` on nodes, ``bridge.role`` on values; see docs/ir.md), so
it works on any saved training graph, not only on a ``TrainingModel`` in memory::

    g = bridge.ir.load("train.onnx")
    for node in g.nodes("backward"):
        print(node.name, node.op_type, node.layer)
    g.gradients["fc.weight"]          # -> "grad_fc.weight"
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

from .contract import KIND, LAYER, PHASE, PHASES, ROLE, UPDATED_PREFIX, Role, grad_name, props, strip_prefix
from .errors import ModelLoadError
from .onnx_file import read_model


@dataclass(frozen=True)
class Node:
    """One ONNX node of the training graph with its annotations."""

    name: str
    op_type: str
    phase: str
    layer: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    proto: onnx.NodeProto


def _graph_inputs_with(role: str, doc: str) -> property:
    """A ``TrainingGraph`` property: its graph inputs of ``role``, in graph order."""
    return property(lambda graph: graph._with_role(role, graph.graph_inputs), doc=doc)


class TrainingGraph:
    """A training-step ONNX model, indexed by role, phase and layer."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        graph = model.graph
        self.metadata: dict[str, str] = props(model.metadata_props)
        self.roles: dict[str, str] = {}
        for value in list(graph.input) + list(graph.output):
            role = props(value.metadata_props).get(ROLE)
            if role is None:
                raise ModelLoadError(f"graph value '{value.name}' has no {ROLE}: not a bridge training graph")
            self.roles[value.name] = role
        for value in graph.value_info:
            role = props(value.metadata_props).get(ROLE)
            if role is not None:
                self.roles.setdefault(value.name, role)
        self.graph_inputs = [v.name for v in graph.input]
        self.outputs = [v.name for v in graph.output]
        self._nodes = [
            Node(n.name, n.op_type, t.get(PHASE, ""), t.get(LAYER, ""), t.get(KIND, ""), tuple(n.input), tuple(n.output), n)
            for n in graph.node
            for t in [props(n.metadata_props)]
        ]
        self._by_name = {node.name: node for node in self._nodes}
        self._producer = {out: node for node in self._nodes for out in node.outputs if out}
        self._consumers: dict[str, list[Node]] = defaultdict(list)
        for node in self._nodes:
            for name in dict.fromkeys(node.inputs):
                if name:
                    self._consumers[name].append(node)

    # -- values by role ------------------------------------------------------------------

    def _with_role(self, role: str, names: list[str]) -> list[str]:
        return [name for name in names if self.roles.get(name) == role]

    inputs = _graph_inputs_with(Role.INPUT, "Data inputs (the source model's inputs).")
    targets = _graph_inputs_with(Role.TARGET, "Loss targets.")
    weights = _graph_inputs_with(Role.WEIGHT, "Trainable weights.")
    buffers = _graph_inputs_with(Role.BUFFER, "Buffers (running statistics: updated, not trained).")
    optimizer_state = _graph_inputs_with(
        Role.OPTIMIZER_STATE, "Optimizer state inputs: ``<weight>.<slot>`` for each weight, and ``step``.")
    hyperparameters = _graph_inputs_with(Role.HYPERPARAMETER, "Hyperparameter inputs (``lr``, ...).")
    random_inputs = _graph_inputs_with(
        Role.RANDOM, "Noise inputs of random ops (``<node>.noise``), drawn fresh every step by the runner.")

    @property
    def loss(self) -> str:
        return self._with_role(Role.LOSS, self.outputs)[0]

    @property
    def gradients(self) -> dict[str, str]:
        """weight -> its gradient output."""
        return {w: grad_name(w) for w in self.weights if self.roles.get(grad_name(w)) == Role.GRADIENT}

    @property
    def updates(self) -> dict[str, str]:
        """state input (weight, buffer, optimizer state) -> the output that replaces it next step."""
        return {strip_prefix(name, UPDATED_PREFIX): name for name in self._with_role(Role.UPDATED, self.outputs)}

    def state_of(self, weight: str) -> dict[str, str]:
        """slot -> optimizer state input of ``weight`` (``{"exp_avg": "fc.weight.exp_avg", ...}``)."""
        prefix = f"{weight}."
        return {n[len(prefix):]: n for n in self.optimizer_state if n.startswith(prefix)}

    @property
    def activations(self) -> list[str]:
        """Intermediate values computed by the forward pass and the loss."""
        return [name for name, role in self.roles.items() if role == Role.ACTIVATION]

    def role(self, value: str) -> str | None:
        """The ``bridge.role`` of a graph input/output or intermediate value."""
        return self.roles.get(value)

    # -- nodes ---------------------------------------------------------------------------

    def nodes(self, phase: str | None = None, layer: str | None = None) -> Iterator[Node]:
        """Nodes in execution order, optionally only of one phase and/or layer."""
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase '{phase}'; phases: {', '.join(PHASES)}")
        for node in self._nodes:
            if (phase is None or node.phase == phase) and (layer is None or node.layer == layer):
                yield node

    def node(self, name: str) -> Node:
        return self._by_name[name]

    def producer(self, value: str) -> Node | None:
        """The node computing ``value`` (None for graph inputs and initializers)."""
        return self._producer.get(value)

    def consumers(self, value: str) -> list[Node]:
        """The nodes reading ``value``, in execution order."""
        return list(self._consumers.get(value, ()))

    def layers(self, phase: str = "forward") -> list[str]:
        """The layers that have nodes in ``phase``, in execution order."""
        return list(dict.fromkeys(node.layer for node in self.nodes(phase)))

    def backward_of(self, layer: str) -> list[Node]:
        """The backward nodes computing the gradients of forward layer ``layer``."""
        return list(self.nodes("backward", layer))

    def update_of(self, weight: str) -> list[Node]:
        """The optimizer nodes that update ``weight`` and its optimizer state."""
        return list(self.nodes("optimizer", weight))


def load(source: str | os.PathLike | onnx.ModelProto) -> TrainingGraph:
    """A ``TrainingGraph`` from a path, a ModelProto or a ``TrainingModel``."""
    return TrainingGraph(read_model(source))
