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
subexpression elimination): bridge's onnxruntime sessions turn that pass off.

The target form ``recompute_from_kept`` (bridge/pipeline/targets.py) runs the same pass without trading:
``rematerialize(..., trade=False)`` recomputes a saved value only when every value it comes from stays
alive anyway (or is a constant), only through arithmetic, comparisons, views and casts (no
transcendental function: an Erf computed twice costs onnx-mlir a C library call per element; no
``affine``), and not when it is a view alone (no bytes of its own). The step then keeps no byte more
than before and computes little more: a transformer's GELU keeps its input and its ``1 + erf``, not also
``x / sqrt(2)`` and its output; a LayerNorm its centred input, not also the normalized one.
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
_aten = torch.ops.aten
_ARITHMETIC = {_aten.add, _aten.sub, _aten.rsub, _aten.mul, _aten.div, _aten.neg, _aten.where, _aten.eq, _aten.ne,
               _aten.lt, _aten.le, _aten.gt, _aten.ge, _aten._to_copy, _aten.clone}  # recomputed without trading


def check_memory(memory: str) -> str:
    """``memory`` if it is a memory mode, else ``InvalidOptionError`` listing them."""
    if not isinstance(memory, str) or memory not in MEMORY_MODES:
        raise InvalidOptionError(f"memory={memory!r} is not a memory mode; choose one of {list(MEMORY_MODES)}")
    return memory


def _phase(node: torch.fx.Node) -> str:
    return (node.meta.get("custom") or {}).get("phase", "")


def _is_forward(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and _phase(node) in _FORWARD


def _recomputable(node: torch.fx.Node, trade: bool = True) -> bool:
    """A forward node whose output is cheap to compute again: elementwise, a view, a cast or ``affine``;
    ``trade=False``: arithmetic, a comparison, a view or a cast only."""
    target = node.target
    if not _is_forward(node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if "rand" in target._schema.name or "bernoulli" in target._schema.name:
        return False
    if _is_view(node):
        return True
    if not trade:
        return target.overloadpacket in _ARITHMETIC
    return target in _CHEAP or torch.Tag.pointwise in target.tags


def _is_view(node: torch.fx.Node) -> bool:
    """An op that returns a view of its input."""
    returns = node.target._schema.returns if isinstance(node.target, torch._ops.OpOverload) else ()
    return len(returns) == 1 and returns[0].alias_info is not None


def _constant(node: torch.fx.Node) -> bool:
    """A node computed from captured constants only (a scalar of the formula lifted into a tensor)."""
    return all(arg.op == "get_attr" for arg in node.all_input_nodes)


def _bytes(node: torch.fx.Node) -> int:
    """The size of a node's tensor output (a symbolic size counted at its traced example value)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    count = 1
    for size in value.shape:
        count *= size if isinstance(size, int) else (size.node.hint or 2)
    return count * value.element_size()


def rematerialize(graph_module: torch.fx.GraphModule, trade: bool = True) -> int:
    """Rewrite the traced step so that its backward recomputes cheap forward values (module docstring);
    returns how many saved values are recomputed. ``trade=False``: only where nothing new stays alive for it
    (the ``recompute_from_kept`` form)."""
    graph = graph_module.graph
    nodes = list(graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    saved = [n for n in nodes if _is_forward(n) and any(not _is_forward(u) and u.op != "output" for u in n.users)]
    saved_set = set(saved)
    recomputed: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # saved value -> its chain, in graph order
    kept: set[torch.fx.Node] = set()  # forward values that stay alive into the backward
    for value in saved:
        if not _recomputable(value, trade):
            kept.add(value)
            continue
        chain, roots = _chain(value, saved_set, recomputed, kept, order, trade)
        if chain is None or not trade and all(_is_view(node) for node in chain):  # a view: no bytes of its own
            kept.add(value)
            continue
        fresh = [root for root in roots if root.op == "call_function" and root not in kept and not _constant(root)]
        # trading: recompute where what must newly stay alive is smaller than the value; else only where nothing must
        worth = sum(_bytes(root) for root in fresh) < _bytes(value) if trade else not fresh
        if worth:
            recomputed[value] = chain
            kept.update(fresh)
        else:
            kept.add(value)
    if recomputed:
        _emit(graph, recomputed)
        graph.lint()
        graph_module.recompile()
    return len(recomputed)


def _chain(value: torch.fx.Node, saved: set[torch.fx.Node], recomputed: dict, kept: set[torch.fx.Node],
           order: dict[torch.fx.Node, int], trade: bool = True):
    """The nodes that recompute ``value`` (in graph order: ``order``, each node's index) and their roots;
    ``(None, None)`` past ``MAX_CHAIN``.
    The walk goes through recomputable nodes that are not saved and through saved values already recomputed;
    kept saved values, graph inputs and non-recomputable nodes are roots."""
    chain: set[torch.fx.Node] = set()
    roots: set[torch.fx.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop()
        if node in chain or node in roots:
            continue
        through = node is value or (_recomputable(node, trade) and (node not in saved or node in recomputed)
                                    and node not in kept)
        if not through:
            roots.add(node)
            continue
        chain.add(node)
        if len(chain) > MAX_CHAIN:
            return None, None
        stack.extend(node.all_input_nodes)
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

