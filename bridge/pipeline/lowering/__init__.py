"""Stage 4, lower: ATen decompositions applied while tracing.

``decomposition_table()`` is torch's core-ATen decomposition table plus bridge's own
lowerings (one module per op family in this package, each registered with ``@lowers``).
Bridge's lowerings replace backward ops that have no standard ONNX form (e.g.
``convolution_backward``) and ops whose usual ONNX form onnx-mlir rejects (e.g. MaxPool's
Indices output, SoftmaxCrossEntropyLoss) with ops that it accepts.
"""
from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch._decomp import core_aten_decompositions

from ..registry import import_submodules, registering


class LoweringFn(Protocol):
    """A lowering: the ATen op's arguments -> what the op returns, computed with ATen ops that have
    emitters; or ``NotImplemented`` to decline (torch then keeps the op as it is, e.g. a
    convolution that is not transposed). It raises only ``bridge.errors.LoweringError``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


LOWERINGS: dict[torch._ops.OpOverload, LoweringFn] = {}


def lowers(*ops: torch._ops.OpOverload):
    """Register ``fn`` as bridge's decomposition of each ATen overload in ``ops`` (once per overload)."""
    return registering(LOWERINGS, ops, "lowerings for ATen op")


def import_all_lowerings() -> None:
    """Import every module of ``bridge.pipeline.lowering`` so that their lowerings register."""
    import_submodules(__name__)


def decomposition_table() -> dict:
    """torch's core-ATen decompositions, with bridge's lowerings in place of torch's for their ops."""
    import_all_lowerings()
    table = dict(_core_aten_decompositions())
    table.update(LOWERINGS)
    return table


@functools.cache
def _core_aten_decompositions() -> dict:
    """torch's core-ATen table, materialised once per process: torch collects it by walking every
    op namespace, and a conversion traces more than once (a dynamic batch's forward, the training step,
    the eval step when its graph is asked for)."""
    return dict(core_aten_decompositions())
