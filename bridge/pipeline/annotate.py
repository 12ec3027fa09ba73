"""Stage 6, annotate: complete node tags, name values, write roles and model metadata.

The exporter stamps each node with the phase/layer/kind the tracer gave its FX node. This
pass works on the whole ONNX graph:

- nodes the tracer could not place (engine-created nodes outside a hooked grad_fn, output
  Identities) take their tags from their graph neighbours (see ``complete_node_tags``);
- values that cross a layer boundary get names that say what they are: a forward layer's
  output takes the source model's value name, the gradient flowing back into it ``grad_<name>``;
- every graph input/output gets ``bridge.role``, every intermediate value (in value_info) the
  role of the phase that produced it;
- the model gets loss, optimizer, source and version metadata.
"""
from __future__ import annotations

import json
from collections import defaultdict

import onnx

from ..contract import (
    KIND,
    LAYER,
    LOSS_LAYER,
    LOSS_NAME,
    LOSS_OPTIONS,
    OPTIMIZER_NAME,
    OPTIMIZER_OPTIONS,
    PHASE,
    RANDOM_INPUTS,
    ROLE,
    SOURCE_MODEL,
    SOURCE_SHA256,
    STEP,
    TAG_KEYS,
    VALUE_ROLES,
    VERSION,
    Phase,
    StepSignature,
    encode_random_inputs,
    grad_name,
    node_prefix,
    props,
    slot_name,
    updated_name,
)
from ..onnx_file import fresh_name, inferred_values, rename_values
from .losses import Loss
from .optimizers import Optimizer


def _set(entries, key: str, value: str) -> None:
    for entry in entries:
        if entry.key == key:
            entry.value = value
            return
    entry = entries.add()
    entry.key, entry.value = key, value


def annotate_model(
    model: onnx.ModelProto,
    signature: StepSignature,
    *,
    source: onnx.ModelProto,
    source_hash: str,
    loss: Loss,
    optimizer: Optimizer,
    version: str,
) -> None:
    """Complete node tags, name boundary values, write roles and metadata (in place)."""
    tags = complete_node_tags(model.graph, signature, optimizer.name)
    name_boundary_values(model.graph, source.graph, tags)
    annotate_values(model, tags)
    roles = {**signature.input_roles(), **signature.output_roles()}
    for value in list(model.graph.input) + list(model.graph.output):
        _set(value.metadata_props, ROLE, roles[value.name])
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.options.items()}
    loss_options = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in loss.options.items()}
    metadata = {
        VERSION: version,
        LOSS_NAME: loss.name,
        LOSS_OPTIONS: json.dumps(loss_options, sort_keys=True),
        OPTIMIZER_NAME: optimizer.name,
        OPTIMIZER_OPTIONS: json.dumps(options, sort_keys=True, default=str),
        SOURCE_MODEL: source.graph.name,
        SOURCE_SHA256: source_hash,
        RANDOM_INPUTS: encode_random_inputs(signature.random),
    }
    for key, value in metadata.items():
        _set(model.metadata_props, key, value)


def _complete(tags: dict[str, str]) -> bool:
    return all(tags.get(key) for key in TAG_KEYS)


def complete_node_tags(graph: onnx.GraphProto, signature: StepSignature, optimizer: str) -> list[dict[str, str]]:
    """Give every node a phase, layer and kind, and a name starting with ``<phase>_<kind>``; returns each node's
    tags as written (its ``metadata_props``, for the passes after this one).

    A node the tracer left incomplete takes, in this order (one pass each): the state it updates
    (``_tags_from_state``); else the tags its producers, or else its consumers, agree on
    (``_tags_from_neighbours``); else the tags of the nearest node of the same phase
    (``_tags_from_nearest``). ``_write_tags`` then stores them and renames the nodes.
    """
    nodes = list(graph.node)
    tags = [props(node.metadata_props) for node in nodes]
    _tags_from_state(nodes, tags, signature, optimizer)
    _tags_from_neighbours(nodes, tags)
    _tags_from_nearest(nodes, tags)
    _write_tags(nodes, tags)
    return tags


def _tags_from_state(nodes: list[onnx.NodeProto], tags: list[dict[str, str]], signature: StepSignature,
                     optimizer: str) -> None:
    """A node without a layer that computes an ``updated_<x>`` output: optimizer phase, layer =
    the weight of ``x`` (``x`` itself for a buffer and ``step``)."""
    owner = {updated_name(w): w for w in signature.weights}
    owner.update({updated_name(slot_name(w, slot)): w for w, slot in signature.state})
    owner.update({updated_name(b): b for b in signature.buffers})
    owner[updated_name(STEP)] = STEP
    for node, t in zip(nodes, tags, strict=True):
        updated = next((owner[out] for out in node.output if out in owner), None)
        if updated and not t.get(LAYER) and t.get(PHASE, Phase.OPTIMIZER) == Phase.OPTIMIZER:
            t.update({PHASE: Phase.OPTIMIZER, LAYER: updated, KIND: t.get(KIND) or optimizer})


def _tags_from_neighbours(nodes: list[onnx.NodeProto], tags: list[dict[str, str]]) -> None:
    """Until nothing changes: an incomplete node takes the (phase, layer, kind) that all its complete
    producers of its phase agree on, else that all its complete consumers agree on (an
    accumulation ``Add`` between two backward nodes of one layer belongs to that layer)."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    consumers: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for name in node.input:
            consumers[name].append(i)
    changed = True
    while changed:
        changed = False
        for i, t in enumerate(tags):
            if _complete(t):
                continue
            before = [producer[x] for x in nodes[i].input if x in producer]
            after = [j for out in nodes[i].output for j in consumers[out]]
            for group in (before, after):
                found = {
                    tuple(tags[j][key] for key in TAG_KEYS)
                    for j in group
                    if _complete(tags[j]) and tags[j][PHASE] == t.get(PHASE, tags[j][PHASE])
                }
                if len(found) == 1:
                    t.update(zip(TAG_KEYS, found.pop(), strict=True))
                    changed = True
                    break


def _tags_from_nearest(nodes: list[onnx.NodeProto], tags: list[dict[str, str]]) -> None:
    """An incomplete node takes the tags of the nearest complete node of its phase, earlier first,
    then later (nodes are in execution order); a phase of one untagged node (a model whose output
    is a weight) gets layer ``model`` and its op type as kind."""
    for i, t in enumerate(tags):
        if _complete(t):
            continue
        nearest = next((tags[j] for j in [*range(i - 1, -1, -1), *range(i + 1, len(tags))]
                        if _complete(tags[j]) and tags[j][PHASE] == t.get(PHASE, tags[j][PHASE])), None)
        if nearest is None:
            nearest = {PHASE: t.get(PHASE, Phase.FORWARD), LAYER: t.get(LAYER) or "model",
                       KIND: t.get(KIND) or nodes[i].op_type}
        t.update({key: nearest[key] for key in TAG_KEYS})


def _write_tags(nodes: list[onnx.NodeProto], tags: list[dict[str, str]]) -> None:
    """Store the tags on the nodes, and rename a node whose name does not start with its
    ``node_prefix`` (a unique ``<prefix><OpType>[_k]``)."""
    taken = {node.name for node in nodes}
    for node, t in zip(nodes, tags, strict=True):
        for key in TAG_KEYS:
            _set(node.metadata_props, key, t[key])
        prefix = node_prefix(t)
        if not node.name.startswith(prefix):
            node.name = fresh_name(prefix + node.op_type, taken)


def name_boundary_values(graph: onnx.GraphProto, source: onnx.GraphProto, tags: list[dict[str, str]]) -> None:
    """Rename values that cross a layer boundary after what they are (in place); ``tags``: each node's
    (``complete_node_tags``).

    - The one value that forward layer ``L`` passes to the forward nodes of the layers that
      consume ``L``'s output (or to the loss) takes the name of that output in the source model
      (when ``L`` has one output in use): ``_activation_names``.
    - The one value that the backward nodes of ``L`` (or of the loss) pass to the backward nodes
      of the layer producing ``L``'s single activation input ``v`` is the gradient of ``v``,
      named ``grad_<v>``, when ``L`` is ``v``'s only consumer (so it is the whole gradient):
      ``_gradient_names``.
    Anything ambiguous keeps its traced name; graph inputs and outputs are never renamed.
    """
    crossings = _Crossings(graph, tags)
    edges = _SourceEdges(source)
    rename = _activation_names(source, edges, crossings)
    rename.update(_gradient_names(source, edges, crossings))
    rename_values(graph.node, rename)


class _SourceEdges:
    """Producer and consumers of each value of the source model; the loss consumes its outputs."""

    def __init__(self, source: onnx.GraphProto):
        self.producer = {out: node.name for node in source.node for out in node.output if out}
        self.consumers: dict[str, list[str]] = defaultdict(list)
        for node in source.node:
            for name in node.input:
                self.consumers[name].append(node.name)
        for out in source.output:
            self.consumers[out.name].append(LOSS_LAYER)


class _Crossings:
    """The values of the training graph passed from the nodes of one (phase, layer) to others,
    and the names still free for a value."""

    def __init__(self, graph: onnx.GraphProto, tags: list[dict[str, str]]):
        self.produced_by: dict[tuple[str, str], set[str]] = defaultdict(set)
        self.readers: dict[str, set[tuple[str, str]]] = defaultdict(set)
        for node, t in zip(graph.node, tags, strict=True):
            for out in node.output:
                self.produced_by[(t[PHASE], t[LAYER])].add(out)
            for name in node.input:
                self.readers[name].add((t[PHASE], t[LAYER]))
        self.fixed = {v.name for v in list(graph.input) + list(graph.output)} | {i.name for i in graph.initializer}
        self.taken = self.fixed | {out for node in graph.node for out in node.output}

    def value(self, phase: str, layer: str, to: set[tuple[str, str]]) -> str | None:
        """The one renamable value that (``phase``, ``layer``) passes to any of ``to``; None when not one."""
        found = [v for v in self.produced_by[(phase, layer)] if v not in self.fixed and self.readers[v] & to]
        return found[0] if len(found) == 1 else None

    def claim(self, value: str | None, name: str, rename: dict[str, str]) -> None:
        """Rename ``value`` to ``name`` when there is a value and the name is free."""
        if value is not None and name not in self.taken:
            rename[value] = name
            self.taken.add(name)


def _activation_names(source: onnx.GraphProto, edges: _SourceEdges, crossings: _Crossings) -> dict[str, str]:
    """Forward boundary values -> the source model's name of the output they carry."""
    rename: dict[str, str] = {}
    for node in source.node:
        live = [o for o in node.output if edges.consumers[o]]
        if len(live) != 1:
            continue
        out = live[0]
        to = {(Phase.LOSS if c == LOSS_LAYER else Phase.FORWARD, c) for c in edges.consumers[out]}
        crossings.claim(crossings.value(Phase.FORWARD, node.name, to), out, rename)
    return rename


def _gradient_names(source: onnx.GraphProto, edges: _SourceEdges, crossings: _Crossings) -> dict[str, str]:
    """Backward boundary values -> ``grad_<v>`` of the activation ``v`` whose whole gradient they are."""
    rename: dict[str, str] = {}
    layers = [(node.name, list(node.input)) for node in source.node]
    layers += [(LOSS_LAYER, [o.name for o in source.output])]
    for layer, inputs in layers:
        activations = [v for v in inputs if v in edges.producer]
        if len(activations) != 1 or edges.consumers[activations[0]] != [layer]:
            continue
        v = activations[0]
        value = crossings.value(Phase.BACKWARD, layer, {(Phase.BACKWARD, edges.producer[v])})
        crossings.claim(value, grad_name(v), rename)
    return rename


def annotate_values(model: onnx.ModelProto, tags: list[dict[str, str]]) -> None:
    """value_info for every intermediate value, with ``bridge.role`` from its producer's phase (``tags``: each
    node's, ``complete_node_tags``)."""
    graph = model.graph
    boundary = {v.name for v in list(graph.input) + list(graph.output)}
    phase_of = {out: t[PHASE] for node, t in zip(graph.node, tags, strict=True) for out in node.output if out}
    inferred = inferred_values(model)
    del graph.value_info[:]
    for value in inferred:
        if value.name in phase_of and value.name not in boundary:
            _set(value.metadata_props, ROLE, VALUE_ROLES[phase_of[value.name]])
            graph.value_info.append(value)
