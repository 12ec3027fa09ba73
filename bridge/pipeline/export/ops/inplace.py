"""In-place ATen ops -> the ONNX of their out-of-place twin.

C++ autograd formulas and CompositeImplicit decompositions mutate fresh temporaries (e.g.
``grad_input.div_(numel)`` in the backward of binary_cross_entropy_with_logits,
``masked_fill_`` -> ``copy_`` in cross_entropy with label smoothing). make_fx routes every
later use of the mutated tensor through the in-place node, so the node means exactly its
out-of-place twin. A read of the mutated tensor (or of a view of it) made after the
mutation through an older node would miss the update: that graph is refused.
"""
from __future__ import annotations

import torch
import torch.fx

from ....errors import LoweringError
from ..builder import EMITTERS, emits

aten = torch.ops.aten

_TWINS = {
    aten.div_.Scalar: aten.div.Scalar,
    aten.div_.Tensor: aten.div.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar,
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.add_.Scalar: aten.add.Scalar,
    aten.add_.Tensor: aten.add.Tensor,
    aten.sub_.Scalar: aten.sub.Scalar,
    aten.sub_.Tensor: aten.sub.Tensor,
    aten.logical_and_.default: aten.logical_and.default,  # hardsigmoid_backward's mask
    aten.detach_.default: aten.detach.default,  # torch.tensor(...) in a lowering (slice_scatter's index)
}


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _check_mutation_is_visible(node: torch.fx.Node) -> None:
    """Refuse when the mutated tensor, or a view of it, is read after ``node`` by another node."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    stack, seen = [node.args[0]], set()
    while stack:
        current = stack.pop()
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user is not node and order[user] > order[node]:
                raise LoweringError(
                    f"in-place {node.target} (FX node '{node.name}') mutates '{current.name}', "
                    f"which '{user.name}' reads afterwards; this mutation has no ONNX form"
                )
            if _is_view(user):
                stack.append(user)
        if _is_view(current):
            stack.append(current.args[0])


def _as_twin(twin):
    def emit(b, node, *args, **kwargs):
        _check_mutation_is_visible(node)
        return EMITTERS[twin](b, node, *args, **kwargs)

    return emit


for _inplace, _twin in _TWINS.items():
    emits(_inplace)(_as_twin(_twin))


@emits(aten.copy_.default)
def copy_(b, node, x, src, non_blocking=False):
    """``src`` cast to ``x``'s dtype and broadcast to its shape (symbolic sizes included)."""
    _check_mutation_is_visible(node)
    value = b.cast(src, node.meta["val"].dtype)
    return EMITTERS[aten.expand.default](b, node, value, list(node.meta["val"].shape))
