"""Cut a graph into pieces that compile separately and run in sequence (onnx-mlir's piecewise compile).

onnx-mlir lowers a whole graph into one LLVM function, and ``opt -O3``'s per-loop passes redo work that
grows with that function for every loop in it, so its compile time grows with about the square of the
node count. Pieces of contiguous nodes (in the graph's topological order) compile each in a fraction of
that time. A piece is a standalone graph: its inputs are the graph inputs and the values of earlier
pieces it reads, its outputs the graph outputs it makes and the values later pieces read. Constants
(initializers, ``Constant`` nodes) are copied into each piece that reads them rather than passed on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from ..contract import PHASE, Phase, updated_name
from ..errors import BridgeError, InvalidOptionError
from ..onnx_file import node_reads

# a cut may move this far (as a fraction of a piece's size) from an even split to one where fewer values cross
_CUT_WINDOW = 0.25

# in_place: the most of the state's bytes one piece replaces (``state_bounded_cuts``). A piece holds the old
# and the new arrays of the state it replaces side by side (and its update's temporaries), so this bounds the
# step's peak above the state and gradients; a smaller share costs a piece call more per cut and barely lowers
# the peak once the largest state array has a piece of its own.
STATE_SHARE_PER_PIECE = 0.125


class UntypedCutError(BridgeError):
    """A value crossing a cut has no type that ONNX shape inference can give (the graph is invalid there):
    ``node`` and ``op`` made it, ``reason`` is shape inference's complaint."""

    def __init__(self, value: str, node: str, op: str, reason: str):
        super().__init__(f"node {node!r} ({op}): ONNX shape inference could not type its output {value!r}: {reason}")
        self.value, self.node, self.op, self.reason = value, node, op, reason


@dataclass(frozen=True)
class Piece:
    """One piece: its standalone graph and the names it reads and makes (in graph input/output order)."""

    model: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def _constant_node(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and not node.input


def _types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Each value's type (shape inference over ``model``; graph inputs and outputs as declared)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError):
        inferred = model
    types = {info.name: info for info in inferred.graph.value_info}
    types.update({info.name: info for info in [*model.graph.input, *model.graph.output]})
    return types


def cut_points(model: onnx.ModelProto, count: int) -> list[int]:
    """The node indices where ``model``'s graph is cut into ``count`` pieces: near an even split, at the
    position within the window where the fewest values cross."""
    nodes = [node for node in model.graph.node if not _constant_node(node)]
    crossing = crossing_counts(model)
    size = len(nodes) / count
    window = max(1, int(size * _CUT_WINDOW))
    cuts = []
    for index in range(1, count):
        even = round(index * size)
        low, high = max(1, even - window, (cuts[-1] + 1) if cuts else 1), min(len(nodes) - 1, even + window)
        cuts.append(min(range(low, high + 1), key=lambda p: (crossing[p], abs(p - even))))
    return cuts


def crossing_counts(model: onnx.ModelProto) -> list[int]:
    """For each position p among the graph's non-constant nodes, how many values made before p are read
    at or after it (the values a cut at p passes from one piece to the next)."""
    nodes = [node for node in model.graph.node if not _constant_node(node)]
    made = {name: index for index, node in enumerate(nodes) for name in node.output if name}
    last_read: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for name in node_reads(node):
            if name in made:
                last_read[name] = index
    delta = [0] * (len(nodes) + 2)
    for name, last in last_read.items():  # live on (made, last]
        delta[made[name] + 1] += 1
        delta[last + 1] -= 1
    counts, live = [], 0
    for position in range(len(nodes) + 1):
        live += delta[position]
        counts.append(live)
    return counts


def state_bounded_cuts(model: onnx.ModelProto, cuts: list[int], share: float) -> list[int]:
    """``cuts`` and, in the optimizer phase, cuts right after nodes that make a new state value (an ``updated_*``
    output: one state array's update is complete there), placed so that no piece replaces more than ``share``
    of the state's bytes, or than the largest state array where that is more (some piece holds it anyway): a
    piece then holds the old and new arrays of only the state it replaces, and the session releases each old
    array after it, without more piece calls than that bound needs. An array that alone reaches that bound is
    also cut after its last read where that read comes before its update (``_release_cuts``)."""
    nodes = [node for node in model.graph.node if not _constant_node(node)]
    in_optimizer = [any(prop.key == PHASE and prop.value == Phase.OPTIMIZER for prop in node.metadata_props)
                    for node in nodes]
    if not any(in_optimizer):
        return cuts
    replaced_bytes = _replaced_bytes(model)
    made_bytes = [sum(replaced_bytes.get(name, 0) for name in node.output) if optimizer else 0
                  for node, optimizer in zip(nodes, in_optimizer, strict=True)]
    limit = max(share * sum(replaced_bytes.values()), max(replaced_bytes.values(), default=0))
    existing, bounded, replaced = set(cuts), list(cuts), 0
    for index, made in enumerate(made_bytes):
        if index in existing:
            replaced = 0
        elif replaced and made_bytes[index - 1] and replaced + _next_update_bytes(made_bytes, index) > limit:
            bounded.append(index)
            replaced = 0
        replaced += made
    return sorted(set(bounded) | _release_cuts(model, nodes, in_optimizer, replaced_bytes, limit))


def _release_cuts(model: onnx.ModelProto, nodes: list[onnx.NodeProto], in_optimizer: list[bool],
                  replaced_bytes: dict[str, int], limit: float) -> set[int]:
    """Cuts right after the last read of an old state array of at least ``limit`` bytes, where that read is an
    optimizer node before the node that makes the array's update (Adam's ``exp_avg_sq * beta2``): the session
    releases the old array there, so that the update and its temporaries take its memory instead of adding to
    it (onnx-mlir allocates every result anew)."""
    last_read: dict[str, int] = {}
    made_at: dict[str, int] = {}
    for index, node in enumerate(nodes):
        last_read.update(dict.fromkeys(node_reads(node), index))
        made_at.update(dict.fromkeys(node.output, index))
    state_of = {updated_name(value.name): value.name for value in model.graph.input}
    cuts = set()
    for updated, size in replaced_bytes.items():
        read = last_read.get(state_of[updated])
        if size >= limit and read is not None and updated in made_at and in_optimizer[read] and read < made_at[updated]:
            cuts.add(read + 1)
    return cuts


def _replaced_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """The bytes of each state input, by the name of its ``updated_*`` output (unknown dims count as 1)."""
    outputs = {value.name for value in model.graph.output}
    sizes = {}
    for value in model.graph.input:
        if updated_name(value.name) in outputs:
            tensor = value.type.tensor_type
            elements = math.prod(dim.dim_value or 1 for dim in tensor.shape.dim)
            sizes[updated_name(value.name)] = elements * onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
    return sizes


def _next_update_bytes(made_bytes: list[int], start: int) -> int:
    """The state bytes that the next node from ``start`` on making new state values replaces (0: none left)."""
    return next((made for made in made_bytes[start:] if made), 0)


def split(model: onnx.ModelProto, count: int | None = None, cuts: list[int] | None = None,
          state_share: float | None = None) -> list[Piece]:
    """``model`` cut into ``count`` pieces (at ``cut_points``) or at the given ``cuts`` (indices among
    the non-constant nodes); nodes must be in topological order, as bridge writes them. ``state_share``:
    the optimizer phase cut further so that no piece replaces more than that share of the state
    (``state_bounded_cuts``)."""
    nodes = [node for node in model.graph.node if not _constant_node(node)]
    if cuts is None:
        if count is None or count < 1:
            raise InvalidOptionError(f"pieces={count!r}: give a number of pieces >= 1")
        cuts = cut_points(model, min(count, max(1, len(nodes))))
    if state_share is not None:
        cuts = state_bounded_cuts(model, cuts, state_share)
    bounds = [0, *cuts, len(nodes)]
    constants = {node.output[0]: node for node in model.graph.node if _constant_node(node)}
    initializers = {init.name: init for init in model.graph.initializer}
    graph_outputs = [output.name for output in model.graph.output]
    types = _types(model)
    spans = [nodes[start:end] for start, end in zip(bounds, bounds[1:], strict=False) if end > start]
    reads_after: list[set[str]] = [set() for _ in spans]  # names read by the pieces after each piece
    later: set[str] = set(graph_outputs)
    for index in range(len(spans) - 1, -1, -1):
        reads_after[index] = set(later)
        for node in spans[index]:
            later |= node_reads(node)
    # graph outputs that are constants come out of the last piece; those that are graph inputs, from the feed
    constant_outputs = [name for name in graph_outputs if name in constants or name in initializers]
    pieces = []
    for index, span in enumerate(spans):
        made = [name for node in span for name in node.output if name]
        made_set = set(made)
        reads = {name for node in span for name in node_reads(node)} - made_set - {""}
        inputs = sorted(name for name in reads if name not in constants and name not in initializers)
        outputs = [name for name in made if name in reads_after[index]]
        if index == len(spans) - 1:
            reads |= set(constant_outputs)
            outputs += constant_outputs
        pieces.append(_piece(model, index, span, inputs, outputs, constants, initializers, reads, types))
    return pieces


def _piece(model: onnx.ModelProto, index: int, span: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
           constants: dict[str, onnx.NodeProto], initializers: dict[str, onnx.TensorProto], reads: set[str],
           types: dict[str, onnx.ValueInfoProto]) -> Piece:
    untyped = [name for name in [*inputs, *outputs] if name not in types]
    if untyped:
        producer = next(node for node in model.graph.node if untyped[0] in node.output)
        try:
            onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
            reason = "no shape inferred"
        except (onnx.shape_inference.InferenceError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[-1][:300]
        raise UntypedCutError(untyped[0], producer.name, producer.op_type, reason)
    graph = onnx.helper.make_graph(
        [constants[name] for name in sorted(reads) if name in constants] + list(span),
        f"{model.graph.name}_piece{index}",
        [types[name] for name in inputs],
        [types[name] for name in outputs],
        [initializers[name] for name in sorted(reads) if name in initializers],
    )
    piece = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    piece.functions.extend(model.functions)
    return Piece(piece, tuple(inputs), tuple(outputs))


def auto_count(model: onnx.ModelProto, nodes_per_piece: int) -> int:
    """The number of pieces of about ``nodes_per_piece`` nodes ``model`` is cut into (1 when small)."""
    nodes = sum(1 for node in model.graph.node if not _constant_node(node))
    return max(1, math.ceil(nodes / nodes_per_piece - 0.5))
