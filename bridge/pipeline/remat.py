"""``memory="min"``: the backward recomputes cheap forward values instead of keeping them alive.

A forward value that a backward node reads stays alive from the forward to that backward node: across
the whole rest of the step for the first layers. Where such a value is cheap to compute again
(elementwise ops, views, casts, BatchNorm's per-channel ``affine``) from values that stay alive anyway,
the backward computes it again right before it reads it, and the forward's copy dies at its last forward
use. torch's min-cut partitioner (``torch._functorch.partitioners``) is the idea; this is a greedy form:

- a *saved* value: a forward (or loss) node that a backward or optimizer node reads;
- a saved value is recomputed from its *roots*: walking its inputs back through recomputable nodes up to
  graph inputs, non-recomputable nodes (convolutions, matrix products, reductions) and saved values that
  are kept. It is recomputed when the roots that would newly stay alive take fewer bytes than it does
  (BatchNorm's output and the ReLU after it, from the centred input BatchNorm's backward keeps anyway);
- a chain of recomputation is at most ``MAX_CHAIN`` nodes long (a residual network's block outputs,
  each computed from the previous one, would otherwise recompute a whole stage).

The recomputation is emitted once per backward layer (the source node whose backward reads it), right
before the first node of that layer that reads it, so a recomputed value lives for one layer's backward.
Every recomputed node is the same op on the same values as the forward's, so the step's results are the
same bit for bit. A runtime must not merge the copies back into the forward's nodes (common
subexpression elimination): bridge's onnxruntime sessions turn that pass off for these graphs.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx

from ..contract import Phase
from ..errors import InvalidOptionError
from .primitives import AFFINE

MEMORY_MODES = ("default", "min")
MAX_CHAIN = 24  # recomputed nodes behind one saved value
_FORWARD = (Phase.FORWARD, Phase.LOSS)
_CHEAP = {AFFINE, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}


def check_memory(memory: str) -> str:
    """``memory`` if it is a memory mode, else ``InvalidOptionError`` listing them."""
    if not isinstance(memory, str) or memory not in MEMORY_MODES:
        raise InvalidOptionError(f"memory={memory!r} is not a memory mode; choose one of {list(MEMORY_MODES)}")
    return memory


def _phase(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get("phase", "")


def _is_forward(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and _phase(node) in _FORWARD


def _recomputable(node: torch.fx.Node) -> bool:
    """A forward node whose output is cheap to compute again: elementwise, a view, a cast or ``affine``."""
    target = node.target
    if not _is_forward(node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if "rand" in target._schema.name or "bernoulli" in target._schema.name:
        return False
    if target in _CHEAP or torch.Tag.pointwise in target.tags:
        return True
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None  # a view of its input


def _bytes(node: torch.fx.Node) -> int:
    """The size of a node's tensor output (a symbolic size counted at its traced example value)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    count = 1
    for size in value.shape:
        count *= size if isinstance(size, int) else (size.node.hint or 2)
    return count * value.element_size()


def rematerialize(graph_module: torch.fx.GraphModule) -> int:
    """Rewrite the traced step so that its backward recomputes cheap forward values (module docstring);
    returns how many saved values are recomputed."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    saved = [n for n in nodes if _is_forward(n) and any(not _is_forward(u) and u.op != "output" for u in n.users)]
    saved_set = set(saved)
    recomputed: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # saved value -> its chain, in graph order
    kept: set[torch.fx.Node] = set()  # forward values that stay alive into the backward
    for value in saved:
        if not _recomputable(value):
            kept.add(value)
            continue
        chain, roots = _chain(value, saved_set, recomputed, kept)
        if chain is None:
            kept.add(value)
            continue
        fresh = [root for root in roots if root.op == "call_function" and root not in kept]
        if sum(_bytes(root) for root in fresh) < _bytes(value):
            recomputed[value] = chain
            kept.update(fresh)
        else:
            kept.add(value)
    if recomputed:
        _emit(graph, recomputed)
        graph.lint()
        graph_module.recompile()
    return len(recomputed)


def _chain(value: torch.fx.Node, saved: set[torch.fx.Node], recomputed: dict, kept: set[torch.fx.Node]):
    """The nodes that recompute ``value`` (in graph order) and their roots; ``(None, None)`` past ``MAX_CHAIN``.
    The walk goes through recomputable nodes that are not saved and through saved values already recomputed;
    kept saved values, graph inputs and non-recomputable nodes are roots."""
    chain: set[torch.fx.Node] = set()
    roots: set[torch.fx.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if node in chain or node in roots:
            continue
        through = node is value or (_recomputable(node) and (node not in saved or node in recomputed)
                                    and node not in kept)
        if not through:
            roots.add(node)
            continue
        chain.add(node)
        if len(chain) > MAX_CHAIN:
            return None, None
        stack.extend(node.all_input_nodes)
    order = {node: index for index, node in enumerate(value.graph.nodes)}
    return sorted(chain, key=order.__getitem__), roots


def _emit(graph: torch.fx.Graph, recomputed: dict[torch.fx.Node, list[torch.fx.Node]]) -> None:
    """Give each backward reader of a recomputed value a copy made within its own layer's backward."""
    copies: dict[tuple[str, torch.fx.Node], torch.fx.Node] = {}  # (backward layer, forward node) -> copy
    for reader in list(graph.nodes):
        if reader.op != "call_function" or _is_forward(reader):
            continue
        wanted = [arg for arg in reader.all_input_nodes if arg in recomputed]
        if not wanted:
            continue
        layer = (reader.meta.get("custom") or {}).get("layer", "")
        with graph.inserting_before(reader):
            for value in wanted:
                reader.replace_input_with(value, _copy(graph, value, recomputed[value], layer, copies))


def _copy(graph: torch.fx.Graph, value: torch.fx.Node, chain: Iterable[torch.fx.Node], layer: str,
          copies: dict) -> torch.fx.Node:
    """The copy of ``value`` for backward ``layer``: ``chain`` copied in order (inserted at the graph's current
    insertion point), reusing the copies this layer already made."""
    members = set(chain)
    for node in chain:
        if (layer, node) in copies:
            continue
        copy = graph.node_copy(node, lambda arg: copies.get((layer, arg), arg) if arg in members else arg)
        copy.meta = {**node.meta, "custom": {**(node.meta.get("custom") or {}), "phase": Phase.BACKWARD}}
        copies[(layer, node)] = copy
    return copies[(layer, value)]

