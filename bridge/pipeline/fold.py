"""Constant folding on the traced step (after ``make_fx``, before dead-code and common-subexpression elimination).

A node computed only from constants the trace captured (``get_attr`` tensors, as they are or through the
``lift_fresh_copy`` tracing wraps them in) is replaced by its value, one constant instead of nodes that recompute it
at every step: e.g. a Gather's constant indices (BERT's position and token-type ids, a pooler's first token) wrapped
from negative to positive and reshaped, in the forward and again in the backward's scatter.

Only integer and boolean values are folded (index arithmetic, comparisons, views and moves of indices, casts of
them): every runtime computes those to the same bits, and the float constants (frozen weights, which keep their
names, selection matrices) stay as they are. A result larger than its largest constant operand (an ``expand``, a
broadcasting comparison) is not folded, so the graph's constants never grow by more than the values they replace.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# ops that only move or select their operands' elements (a pointwise op needs no listing)
_MOVES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.clone.default,
    aten.cat.default, aten.t.default, aten.transpose.int, aten.index_select.default, aten.alias.default,
})
_EXACT_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def fold_constants(graph_module: torch.fx.GraphModule) -> int:
    """Replace each foldable node of ``graph_module`` (module docstring) by a ``get_attr`` of its value, in place;
    returns how many were folded. The nodes they read are left to dead-code elimination."""
    graph, folded, index = graph_module.graph, 0, 0
    for node in list(graph.nodes):
        operands = [_constant(graph_module, n) for n in node.all_input_nodes]
        if (node.op != "call_function" or node.target is aten.lift_fresh_copy.default or not operands
                or any(operand is None for operand in operands)):
            continue
        if not _exact(node, operands) or not _small(node, operands):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _constant(graph_module, n))
        value = node.target(*args, **kwargs)
        while hasattr(graph_module, name := f"_folded_constant{index}"):
            index += 1
        graph_module.register_buffer(name, value.clone() if value._base is not None else value)
        with graph.inserting_before(node):
            constant = graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        graph.erase_node(node)
        folded += 1
    return folded


def _constant(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The value of a ``get_attr`` node, or of ``lift_fresh_copy`` of one; None for any other node."""
    if node.op == "call_function" and node.target is aten.lift_fresh_copy.default:
        node = node.args[0]
    return getattr(graph_module, node.target) if node.op == "get_attr" else None


def _exact(node: torch.fx.Node, operands: list[torch.Tensor]) -> bool:
    """Whether ``node`` (reading ``operands``) computes integer or boolean values from integer or boolean values only,
    or casts them (module docstring)."""
    if not isinstance(node.meta.get("val"), torch.Tensor) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if not all(operand.dtype in _EXACT_DTYPES for operand in operands):
        return False
    return node.target is aten._to_copy.default or (node.meta["val"].dtype in _EXACT_DTYPES and (
        node.target in _MOVES or torch.Tag.pointwise in node.target.tags))


def _small(node: torch.fx.Node, operands: list[torch.Tensor]) -> bool:
    """Whether ``node``'s static result has no more elements than its largest operand (of ``operands``)."""
    value = node.meta["val"]
    return (all(isinstance(size, int) for size in value.shape)
            and value.numel() <= max(operand.numel() for operand in operands))
