"""The ``memory_order`` form: the step graph's nodes ordered so that fewer values are alive at once.

onnxruntime runs a bridge graph's nodes in the file's order (bridge's sessions ask for its priority-based
order, which with equal priorities is the file's topological order), and it frees a value after its last
reader. Two moves, each a pure reordering (the same nodes on the same values, so the same step bit for bit):

- *hoist*: every optimizer node runs as early as its inputs allow, so a weight's update follows its
  gradient's last node and the gradient dies there, instead of every gradient staying alive until an
  optimizer phase at the end of the step;
- *sink*: a node whose inputs all stay alive past its first reader anyway (weights, optimizer state, values
  read later) runs right before that reader, so its output lives no longer than needed (Adam's
  ``beta2 * v`` then waits until the squared gradient it is added to is computed and the gradient freed).
"""
from __future__ import annotations

import onnx

from ..contract import PHASE, Phase, props
from ..errors import LoweringError
from ..onnx_file import node_reads

_SINK_STEP = 1e-6  # a sunk node's position: just before its first reader's (a chain sinks one step each)


def order_for_memory(graph: onnx.GraphProto) -> None:
    """Reorder ``graph``'s nodes in place (see the module docstring); ``graph`` must be in topological order."""
    nodes = _hoist_optimizer(list(graph.node))
    nodes = _sink(nodes, {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer},
                  {value.name for value in graph.output})
    _check_topological(nodes, graph)
    del graph.node[:]
    graph.node.extend(nodes)


def _hoist_optimizer(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each optimizer node moved right after the latest producer of its inputs outside the
    optimizer phase (optimizer nodes keep their relative order): sorted by (anchor, hoisted, index)."""
    anchor_of: dict[str, int] = {}  # value -> the index of the non-optimizer node its producer hangs after
    keys = []
    for index, node in enumerate(nodes):
        hoisted = props(node.metadata_props).get(PHASE) == Phase.OPTIMIZER
        anchor = max((anchor_of.get(name, -1) for name in node_reads(node)), default=-1) if hoisted else index
        anchor_of.update({name: anchor for name in node.output})
        keys.append((anchor, int(hoisted), index))
    return [nodes[i] for i in sorted(range(len(nodes)), key=keys.__getitem__)]


def _sink(nodes: list[onnx.NodeProto], never_freed: set[str], graph_outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each node whose inputs outlive its first reader anyway moved right before that reader
    (from the last node back, so that a chain of such nodes sinks together)."""
    reads = [node_reads(node) - {""} for node in nodes]
    readers: dict[str, list[int]] = {}
    for index, names in enumerate(reads):
        for name in names:
            readers.setdefault(name, []).append(index)
    position = [float(index) for index in range(len(nodes))]
    for index in reversed(range(len(nodes))):
        outputs = [name for name in nodes[index].output if name]
        if not outputs or graph_outputs.intersection(outputs):
            continue
        first = min((position[r] for name in outputs for r in readers.get(name, ())), default=None)
        if first is None or first - _SINK_STEP <= position[index]:
            continue
        if all(name in never_freed or max((position[r] for r in readers[name] if r != index), default=-1.0) >= first
               for name in reads[index]):
            position[index] = first - _SINK_STEP
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (position[i], i))]


def _check_topological(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> None:
    """``LoweringError`` (a bridge bug) if a node of ``nodes`` reads a value produced after it."""
    available = {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer} | {""}
    produced = {name for node in nodes for name in node.output}
    for node in nodes:
        late = [name for name in node_reads(node) if name in produced and name not in available]
        if late:
            raise LoweringError(f"memory_order put node '{node.name}' before the producer of {late} (a bridge bug: "
                                "please report it)")
        available.update(node.output)
