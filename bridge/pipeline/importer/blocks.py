"""Stage 2, import: the repeated blocks of an ONNX graph, for whole-block replay while tracing.

A cut is the start or end of the node list, or a place in it where exactly one value computed before it (a graph
input counts as computed before the first node) is read after it or is a graph output. Values that do not depend on
the graph's inputs (initializers, Constant nodes and what is computed from them alone) are not counted: a block reads
them as arguments. A segment is the run of nodes between two neighbouring cuts, without the constants at its start.
Two segments are alike when their nodes are the same ops with the same attributes, wired the same way to each other
and to the segment's arguments (``Segment.signature``). The values of the arguments are not part of it: the importer
keys the constant ones and ``bridge.pipeline.replay.BlockReplay`` the tensors, at run time. Only segments with a
twin in the graph are returned.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import onnx

from ...onnx_file import node_reads


@dataclass(frozen=True)
class Segment:
    """Nodes ``start``..``end - 1`` of a graph, reading ``args`` (names from outside, in order of first read) and
    giving ``output``; ``signature``: its structure (ops, attributes, wiring), ``layers``: its node names."""

    start: int
    end: int
    args: tuple[str, ...]
    output: str
    signature: tuple
    layers: tuple[str, ...]


def repeated_segments(graph: onnx.GraphProto, replayable: Callable[[onnx.NodeProto], bool]) -> dict[int, Segment]:
    """The segments of ``graph`` (module docstring) whose signature occurs at least twice, by start index; only
    segments of ``replayable`` nodes without subgraphs, of two nodes or more."""
    nodes = list(graph.node)
    free = {init.name for init in graph.initializer}  # values that do not depend on the graph's inputs
    for node in nodes:
        if node_reads(node) <= free:
            free.update(node.output)
    produced = {value.name: -1 for value in graph.input if value.name not in free}  # graph inputs: before node 0
    produced.update({name: index for index, node in enumerate(nodes) for name in node.output if name and name not in free})
    last_read: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node_reads(node):
            last_read[name] = index
    for output in graph.output:
        last_read[output.name] = len(nodes)
    crossing = [0] * (len(nodes) + 2)  # crossing[i]: values produced before node i and read from node i on
    for name, index in produced.items():
        if last_read.get(name, index) > index:
            crossing[index + 1] += 1
            crossing[last_read[name] + 1] -= 1
    cuts, count = [0], crossing[0]
    for index in range(1, len(nodes)):
        count += crossing[index]
        if count == 1:
            cuts.append(index)
    cuts.append(len(nodes))
    segments = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        while start < end and all(name in free for name in nodes[start].output):
            start += 1  # a constant before the block (an exporter's Constant nodes) runs as it is, the block reads it
        segment = _segment(nodes, start, end, free, last_read, replayable)
        if segment is not None:
            segments.append(segment)
    twins = collections.Counter(segment.signature for segment in segments)
    return {segment.start: segment for segment in segments if twins[segment.signature] > 1}


def _segment(nodes: list[onnx.NodeProto], start: int, end: int, free: set[str], last_read: dict[str, int],
             replayable: Callable[[onnx.NodeProto], bool]) -> Segment | None:
    part = nodes[start:end]
    if len(part) < 2 or not all(replayable(node) for node in part):
        return None
    outputs = [name for node in part for name in node.output if name and last_read.get(name, -1) >= end]
    if len(outputs) != 1 or outputs[0] in free:
        return None
    local: dict[str, tuple[int, int]] = {}
    args: dict[str, int] = {}
    signature = []
    for position, node in enumerate(part):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None
        wiring = tuple(None if not name else ("node", *local[name]) if name in local
                       else ("arg", args.setdefault(name, len(args))) for name in node.input)
        attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
        signature.append((node.domain, node.op_type, attributes, wiring, tuple(bool(name) for name in node.output)))
        local.update({name: (position, index) for index, name in enumerate(node.output) if name})
    signature.append(local[outputs[0]])
    return Segment(start, end, tuple(args), outputs[0], tuple(signature), tuple(node.name for node in part))
