"""Dead-code and common-subexpression elimination on the traced step (after ``make_fx``, before export).

``eliminate_dead_code`` is ``torch.fx.Graph.eliminate_dead_code`` (the same nodes removed) with each ATen op's
purity looked up once per op, not once per node (that lookup was most of its time).

The optimizer rules are written per tensor, as torch.optim's are, so every weight's update
recomputes the same step-dependent scalars (Adam: ``beta ** step``, the bias corrections, their
float64 casts); the backward of a weight read twice transposes it twice. Two call nodes with the
same target and the same arguments compute the same value, so one is kept and the other's users
read it: the arithmetic of every value is unchanged, bit for bit.

Nodes merge only within one half of the step (forward, loss and backward; the optimizer): a split
step's gradient and update graphs (``trace.split_step``) stay apart, while a backward node that
recomputes a forward value (tiled max pooling's ``MaxPool`` of the forward input) reads the
forward's (the kept node is always the earlier one). Never when impure (in-place or random), and
float arguments compare by their exact repr (so ``0.0`` and ``-0.0`` differ). Optimizer nodes of different
layers merge only where they compute a per-step scalar (they read nothing but the graph's inputs,
constants and other per-step scalars); the merged node is re-tagged to the optimizer's ``step`` layer. Two weights whose
gradients are one value (the biases of two BatchNorms summed into one Add) keep their own updates.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from ..contract import Phase

_SHARED_LAYER = "step"


def _key(value: Any) -> Hashable:
    """A hashable stand-in for an FX argument that tells apart values Python calls equal."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, (torch.fx.Node, int, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError(type(value))


def _tags(node: torch.fx.Node) -> dict:
    return node.meta.get("custom") or {}


def _mutates(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and (schema.is_mutable or "rand" in schema.name or "bernoulli" in schema.name)


def _pure(node: torch.fx.Node, known: dict) -> bool:
    """``not node.is_impure()``, memoised in ``known`` per ATen op (an OpOverload's purity depends on the op alone:
    its schema, its registration as effectful or random), computed per node for any other target."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return not node.is_impure()
    if node.target not in known:
        known[node.target] = not node.is_impure()
    return known[node.target]


def eliminate_dead_code(graph: torch.fx.Graph) -> int:
    """Remove the pure nodes no other node reads, last to first, as ``Graph.eliminate_dead_code`` does (the
    graph's inputs and output stay); returns how many were removed."""
    known: dict = {}
    removed = 0
    for node in reversed(graph.nodes):
        if not node.users and _pure(node, known):
            graph.erase_node(node)
            removed += 1
    return removed


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> int:
    """Merge duplicate pure call nodes of ``graph`` in place; returns how many were removed.

    A node that an in-place op later writes (a fresh temporary of a C++ backward formula) is
    never merged: two writers would then share one tensor."""
    seen: dict[Hashable, torch.fx.Node] = {}
    known: dict = {}
    per_step: set[torch.fx.Node] = set()  # optimizer nodes that read only the graph's inputs, constants and such nodes
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node, known) or _mutates(node.target):
            continue
        optimizer = _tags(node).get("phase") == Phase.OPTIMIZER
        if optimizer and all(arg.op in ("placeholder", "get_attr") or arg in per_step for arg in node.all_input_nodes):
            per_step.add(node)
        if any(user.op == "call_function" and _mutates(user.target) for user in node.users):
            continue
        layer = None if not optimizer or node in per_step else _tags(node).get("layer")
        try:
            key = (node.target, optimizer, layer, _key(node.args), _key(node.kwargs))
        except TypeError:  # an argument without a reliable equality (a tensor constant, a SymFloat...)
            continue
        kept = seen.setdefault(key, node)
        if kept is node:
            continue
        kept_tags, tags = _tags(kept), _tags(node)
        if kept_tags.get("phase") == "optimizer" and kept_tags.get("layer") != tags.get("layer"):
            kept.meta["custom"] = {**kept_tags, "layer": _SHARED_LAYER}
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        removed += 1
    return removed
