"""Clean-up of an exported step graph: copies the export leaves behind, removed in place.

Each FX op becomes its own ONNX node, so a value transposed in the forward and transposed back
by its backward formula (a Gemm weight: ``t(t(W))``; its gradient: ``t(t(grad_y^T x))``) is
copied twice for nothing. Rewrites, all exact (no arithmetic changes):

- ``Transpose(Transpose(x, p), q)``: ``x`` when the permutations cancel, else one Transpose;
- ``Reshape(Reshape(x, a), b)``: ``Reshape(x, b)`` when ``b`` is a constant without 0 entries
  (a 0 copies a dim of the input, which the inner Reshape may have changed);
- ``Identity(x)``: ``x``;

then the nodes whose outputs nothing reads any more are dropped, with the initializers (shapes)
only they read. A graph output keeps its name
(the value's producer is renamed to it); values that a subgraph reads from the outer scope are
left alone.
"""
from __future__ import annotations

import collections

import onnx
from onnx import numpy_helper

from ..attributes import attribute
from ..onnx_file import subgraph_reads

_PURE_SOURCES = {"Transpose", "Reshape", "Identity"}  # the only ops this pass makes dead


def clean_up(model: onnx.ModelProto) -> dict[str, int]:
    """Apply the rewrites to ``model``'s main graph in place; returns how many of each were made."""
    graph = model.graph
    done: collections.Counter = collections.Counter()
    protected = subgraph_reads(graph)
    constants = _shape_constants(graph)
    producers = {out: node for node in graph.node for out in node.output}
    for node in list(graph.node):
        source = producers.get(node.input[0]) if node.input else None
        if node.op_type == "Identity":
            done["Identity"] += _forward(graph, node, node.input[0], protected, producers)
        elif node.op_type == "Transpose" and source is not None and source.op_type == "Transpose":
            done["Transpose pair"] += _merge_transposes(graph, node, source, protected, producers)
        elif node.op_type == "Reshape" and source is not None and source.op_type == "Reshape":
            shape = constants.get(node.input[1])
            if shape is not None and 0 not in shape and not attribute(node, "allowzero", 0):
                node.input[0] = source.input[0]
                done["Reshape chain"] += 1
    done["dead node"] = _drop_dead(graph, protected)
    produced = {name for node in graph.node for name in node.output}
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output} | protected
    _keep(graph.value_info, lambda info: info.name in produced)
    _keep(graph.initializer, lambda tensor: tensor.name in read)
    return {key: count for key, count in done.items() if count}


def _merge_transposes(graph: onnx.GraphProto, node: onnx.NodeProto, inner: onnx.NodeProto, protected: set[str],
                      producers: dict[str, onnx.NodeProto]) -> int:
    outer_perm, inner_perm = attribute(node, "perm", None), attribute(inner, "perm", None)
    if outer_perm is None or inner_perm is None:  # a default (reversing) perm: rank unknown here
        return 0
    composed = [inner_perm[axis] for axis in outer_perm]
    if composed == list(range(len(composed))):
        return _forward(graph, node, inner.input[0], protected, producers)
    node.input[0] = inner.input[0]
    next(a for a in node.attribute if a.name == "perm").ints[:] = composed
    return 1


def _forward(graph: onnx.GraphProto, node: onnx.NodeProto, value: str, protected: set[str],
             producers: dict[str, onnx.NodeProto]) -> int:
    """Make the readers of ``node``'s output read ``value`` instead (``node`` becomes dead); 1 if done."""
    out = node.output[0]
    if out in protected or value in protected:
        return 0
    outputs = {o.name for o in graph.output}
    if out in outputs:  # the graph output keeps its name: the value's producer takes it
        producer = producers.get(value)
        if producer is None or value in outputs:
            return 0
        _rename(graph, value, out)
        producer.output[list(producer.output).index(value)] = out
        producers[out] = producer
        graph.node.remove(node)
    else:
        _rename(graph, out, value)
    return 1


def _keep(items, keep) -> None:
    """Remove the entries of a repeated protobuf field that ``keep`` rejects, in place: re-adding the
    kept ones would copy each (an initializer's data too; protobuf cannot copy one over 2 GiB)."""
    for index in reversed(range(len(items))):
        if not keep(items[index]):
            del items[index]


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node input reading ``old`` reads ``new``."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _drop_dead(graph: onnx.GraphProto, protected: set[str]) -> int:
    """Remove Transpose/Reshape/Identity nodes whose outputs nothing reads, and those that only such nodes read;
    the count. One pass from the last node back (the graph is in topological order, as bridge writes it: a node's
    readers come after it), then one deletion per dead node by its index: linear in the graph's size."""
    readers = collections.Counter(name for node in graph.node for name in node.input)
    kept = {o.name for o in graph.output} | protected
    dead = []
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if node.op_type in _PURE_SOURCES and not any(readers[name] or name in kept for name in node.output):
            dead.append(index)
            readers.subtract(node.input)
    for index in dead:  # from the last: the indices of those still to delete do not move
        del graph.node[index]
    return len(dead)


def _shape_constants(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """1-d int64 initializers and Constant outputs: the candidate Reshape shapes."""
    tensors = {t.name: t for t in graph.initializer}
    tensors.update({node.output[0]: node.attribute[0].t for node in graph.node
                    if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"})
    return {name: numpy_helper.to_array(t).tolist() for name, t in tensors.items()
            if t.data_type == onnx.TensorProto.INT64 and len(t.dims) == 1}
