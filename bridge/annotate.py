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

from .export.builder import node_prefix
from .load import skeleton
from .losses import Loss
from .optimizers import Optimizer
from .runtime import RANDOM_INPUTS
from .trace import StepSignature, output_name

ROLE, PHASE, LAYER, KIND = "bridge.role", "bridge.phase", "bridge.layer", "bridge.kind"
PHASES = ("forward", "loss", "backward", "optimizer")
INPUT_ROLES = ("input", "target", "weight", "buffer", "optimizer_state", "hyperparameter", "random", "gradient")
OUTPUT_ROLES = ("loss", "gradient", "updated", "output")
VALUE_ROLES = {"forward": "activation", "loss": "activation", "backward": "gradient", "optimizer": "update"}
LOSS_LAYER = "loss"


def input_roles(signature: StepSignature) -> dict[str, str]:
    roles = {name: "weight" for name in signature.weights}
    roles.update({name: "buffer" for name in signature.buffers})
    roles.update({f"{w}.{slot}": "optimizer_state" for w, slot in signature.state})
    roles.update({"step": "optimizer_state", "lr": "hyperparameter", "target": "target"})
    roles.update({name: "input" for name in signature.inputs})
    roles.update({name: "random" for name in signature.random})
    if signature.part == "update":
        roles.update({name: "gradient" for name in signature.gradient_names()})
    return roles


def output_roles(signature: StepSignature) -> dict[str, str]:
    roles = {"loss": "loss"}
    roles.update({f"grad_{w}": "gradient" for w in signature.weights})
    roles.update({name: "updated" for name in signature.output_names() if name.startswith("updated_")})
    roles.update({output_name(name): "output" for name in signature.outputs})
    return roles


def props(entries) -> dict[str, str]:
    """``metadata_props`` as a dict."""
    return {entry.key: entry.value for entry in entries}


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
    complete_node_tags(model.graph, signature, optimizer.name)
    name_boundary_values(model.graph, source.graph)
    annotate_values(model)
    roles = {**input_roles(signature), **output_roles(signature)}
    for value in list(model.graph.input) + list(model.graph.output):
        _set(value.metadata_props, ROLE, roles[value.name])
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.options.items()}
    loss_options = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in loss.options.items()}
    metadata = {
        "bridge.version": version,
        "bridge.loss": loss.name,
        "bridge.loss_options": json.dumps(loss_options, sort_keys=True),
        "bridge.optimizer": optimizer.name,
        "bridge.optimizer_options": json.dumps(options, sort_keys=True, default=str),
        "bridge.source_model": source.graph.name,
        "bridge.source_sha256": source_hash,
        RANDOM_INPUTS: json.dumps(signature.random),
    }
    for key, value in metadata.items():
        _set(model.metadata_props, key, value)


def _complete(tags: dict[str, str]) -> bool:
    return all(tags.get(key) for key in (PHASE, LAYER, KIND))


def complete_node_tags(graph: onnx.GraphProto, signature: StepSignature, optimizer: str) -> None:
    """Give every node a phase, layer and kind, and a name starting with ``<phase>_<kind>``.

    A node the tracer left incomplete takes, in this order: the state it updates (an
    ``updated_<x>`` output: optimizer phase, layer = the weight of ``x``); else the tags of its
    producers, or else of its consumers, when those agree on one (phase, layer, kind) (an
    accumulation ``Add`` between two backward nodes of one layer belongs to that layer);
    else the tags of the nearest earlier node of the same phase (nodes are in execution order).
    """
    nodes = list(graph.node)
    tags = [props(node.metadata_props) for node in nodes]
    owner = {f"updated_{w}": w for w in signature.weights}
    owner.update({f"updated_{w}.{slot}": w for w, slot in signature.state})
    owner.update({f"updated_{b}": b for b in signature.buffers})
    owner["updated_step"] = "step"
    for node, t in zip(nodes, tags):
        updated = next((owner[out] for out in node.output if out in owner), None)
        if updated and not t.get(LAYER) and t.get(PHASE, "optimizer") == "optimizer":
            t.update({PHASE: "optimizer", LAYER: updated, KIND: t.get(KIND) or optimizer})

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
                    (tags[j][PHASE], tags[j][LAYER], tags[j][KIND])
                    for j in group
                    if _complete(tags[j]) and tags[j][PHASE] == t.get(PHASE, tags[j][PHASE])
                }
                if len(found) == 1:
                    t.update(zip((PHASE, LAYER, KIND), found.pop()))
                    changed = True
                    break
    for i, t in enumerate(tags):
        if not _complete(t):  # the nearest tagged node of its phase, earlier first, then later
            nearest = next((tags[j] for j in [*range(i - 1, -1, -1), *range(i + 1, len(tags))]
                            if _complete(tags[j]) and tags[j][PHASE] == t.get(PHASE, tags[j][PHASE])), None)
            if nearest is None:  # a phase of one untagged node (a model whose output is a weight)
                nearest = {PHASE: t.get(PHASE, "forward"), LAYER: t.get(LAYER) or "model", KIND: t.get(KIND) or nodes[i].op_type}
            t.update({key: nearest[key] for key in (PHASE, LAYER, KIND)})

    taken = {node.name for node in nodes}
    for node, t in zip(nodes, tags):
        for key in (PHASE, LAYER, KIND):
            _set(node.metadata_props, key, t[key])
        prefix = node_prefix(t)
        if not node.name.startswith(prefix):
            name, k = prefix + node.op_type, 0
            while name in taken:
                k += 1
                name = f"{prefix}{node.op_type}_{k}"
            taken.add(name)
            node.name = name


def name_boundary_values(graph: onnx.GraphProto, source: onnx.GraphProto) -> None:
    """Rename values that cross a layer boundary after what they are (in place).

    - The one value that forward layer ``L`` passes to the forward nodes of the layers that
      consume ``L``'s output (or to the loss) takes the name of that output in the source model
      (when ``L`` has one output in use).
    - The one value that the backward nodes of ``L`` (or of the loss) pass to the backward nodes
      of the layer producing ``L``'s single activation input ``v`` is the gradient of ``v``,
      named ``grad_<v>``, when ``L`` is ``v``'s only consumer (so it is the whole gradient).
    Anything ambiguous keeps its traced name; graph inputs and outputs are never renamed.
    """
    nodes = list(graph.node)
    tags = [props(node.metadata_props) for node in nodes]
    source_producer = {out: node.name for node in source.node for out in node.output if out}
    source_consumers: dict[str, list[str]] = defaultdict(list)
    for node in source.node:
        for name in node.input:
            source_consumers[name].append(node.name)
    for out in source.output:
        source_consumers[out.name].append(LOSS_LAYER)

    produced_by: dict[tuple[str, str], set[str]] = defaultdict(set)
    readers: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for node, t in zip(nodes, tags):
        for out in node.output:
            produced_by[(t[PHASE], t[LAYER])].add(out)
        for name in node.input:
            readers[name].add((t[PHASE], t[LAYER]))

    fixed = {v.name for v in list(graph.input) + list(graph.output)} | {i.name for i in graph.initializer}
    taken = fixed | {out for node in nodes for out in node.output}
    rename: dict[str, str] = {}

    def crossing(phase: str, layer: str, to: set[tuple[str, str]]) -> str | None:
        found = [v for v in produced_by[(phase, layer)] if v not in fixed and readers[v] & to]
        return found[0] if len(found) == 1 else None

    for node in source.node:
        live = [o for o in node.output if source_consumers[o]]
        if len(live) != 1:
            continue
        out = live[0]
        to = {("loss" if c == LOSS_LAYER else "forward", c) for c in source_consumers[out]}
        value = crossing("forward", node.name, to)
        if value is not None and out not in taken:
            rename[value] = out
            taken.add(out)

    layers = [(node.name, list(node.input)) for node in source.node]
    layers += [(LOSS_LAYER, [o.name for o in source.output])]
    for layer, inputs in layers:
        activations = [v for v in inputs if v in source_producer]
        if len(activations) != 1 or source_consumers[activations[0]] != [layer]:
            continue
        v = activations[0]
        value = crossing("backward", layer, {("backward", source_producer[v])})
        name = f"grad_{v}"
        if value is not None and name not in taken:
            rename[value] = name
            taken.add(name)

    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)


def annotate_values(model: onnx.ModelProto) -> None:
    """value_info for every intermediate value, with ``bridge.role`` from its producer's phase."""
    graph = model.graph
    boundary = {v.name for v in list(graph.input) + list(graph.output)}
    phase_of = {
        out: props(node.metadata_props)[PHASE] for node in graph.node for out in node.output if out
    }
    inferred = onnx.shape_inference.infer_shapes(skeleton(model)).graph.value_info  # no copy of the weights
    del graph.value_info[:]
    for value in inferred:
        if value.name in phase_of and value.name not in boundary:
            _set(value.metadata_props, ROLE, VALUE_ROLES[phase_of[value.name]])
            graph.value_info.append(value)
