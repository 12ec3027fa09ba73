"""One-element operands given the rank of the tensor they broadcast against: the ``scalar_ranks`` form of
bridge/pipeline/targets.py, a post-pass on the exported graph (bridge/api.py runs it where the target uses it).

onnxruntime's CPU broadcaster walks the dims of a binary op from the last one; when the lower-rank
operand is all ones and the dims of the other operand it lines up with are ones too (a ``[512, 256, 1, 1]``
weight times a 0-d ``0.9``; ``[1, C, 1, 1]`` plus ``eps``), it calls its kernel once per element instead of
once per tensor. The rewrite gives such an operand the other's rank (a reshaped copy of a constant, else a
Reshape node), which broadcasts to the same values: exact.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..onnx_file import fresh_name, inferred_values, subgraph_reads

# binary ops with multidirectional (numpy) broadcasting that onnxruntime runs through its Broadcaster
_BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "LessOrEqual", "Greater",
           "GreaterOrEqual", "And", "Or", "Xor", "PRelu", "BitShift"}


def match_scalar_ranks(model: onnx.ModelProto) -> int:
    """Rewrite ``model``'s main graph in place (see the module docstring); returns how many operands changed."""
    graph = model.graph
    shapes = _static_shapes(model)
    constants = {tensor.name: tensor for tensor in graph.initializer}
    outer = subgraph_reads(graph)  # values a subgraph reads: never dropped
    names = {name for node in graph.node for name in [*node.input, *node.output]} | set(constants) | outer
    made: dict[tuple[str, int], str] = {}  # (operand, rank) -> its value of that rank
    nodes, changed = [], 0
    for node in graph.node:
        if node.op_type in _BINARY and len(node.input) == 2:
            for index, rank in _ranked_operands(node, shapes):
                key = (node.input[index], rank)
                if key not in made:
                    made[key] = fresh_name(f"{node.input[index]}_rank{rank}", names)
                    _add_ranked(graph, nodes, node, key, made[key], constants, names)
                node.input[index] = made[key]
                changed += 1
        nodes.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
        read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output} | outer
        orphans = {source for source, _ in made if source in constants and source not in read}
        for index in reversed(range(len(graph.initializer))):
            if graph.initializer[index].name in orphans:
                del graph.initializer[index]
    return changed


def _ranked_operands(node: onnx.NodeProto, shapes: dict[str, list]) -> list[tuple[int, int]]:
    """(input index, rank to give it) for an input of ``node`` that hits onnxruntime's slow broadcast."""
    pair = [shapes.get(name) for name in node.input]
    if any(shape is None for shape in pair):
        return []
    low, high = sorted(range(2), key=lambda i: len(pair[i]))
    small, big = pair[low], pair[high]
    lined_up = big[len(big) - max(len(small), 1):]
    if len(small) == len(big) or any(d != 1 for d in small) or any(d != 1 for d in lined_up):
        return []
    return [] if all(d == 1 for d in big) else [(low, len(big))]


def _add_ranked(graph: onnx.GraphProto, nodes: list, reader: onnx.NodeProto, key: tuple[str, int], name: str,
                constants: dict[str, TensorProto], names: set[str]) -> None:
    """Make ``name``: operand ``key[0]`` with shape ``[1] * key[1]``; a Reshape goes into ``nodes``
    (before ``reader``, whose metadata it takes)."""
    source, rank = key
    if source in constants:
        tensor = graph.initializer.add()
        tensor.CopyFrom(constants[source])
        tensor.name = name
        tensor.dims[:] = [1] * rank
        return
    shape = fresh_name(f"ones_{rank}d", names)
    graph.initializer.add().CopyFrom(helper.make_tensor(shape, TensorProto.INT64, [rank], [1] * rank))
    reshape = helper.make_node("Reshape", [source, shape], [name], name=fresh_name(f"{reader.name}/rank", names))
    reshape.metadata_props.extend(reader.metadata_props)
    nodes.append(reshape)


def _static_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Value name -> shape (a symbolic dim as None): the graph's inputs, outputs and initializers, and
    every value whose shape ONNX shape inference finds (the exported graph has no value_info yet)."""
    graph = model.graph
    inferred = inferred_values(model)
    shapes: dict[str, list] = {}
    for info in [*graph.input, *inferred, *graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    shapes.update({tensor.name: list(tensor.dims) for tensor in graph.initializer})
    return shapes

