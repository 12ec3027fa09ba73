"""Stage 4, lower: ATen decompositions applied while tracing.

``decomposition_table()`` is torch's core-ATen decomposition table plus bridge's own
lowerings (one module per op family in this package, each registered with ``@lowers``).
Bridge's lowerings replace backward ops that have no standard ONNX form (e.g.
``convolution_backward``) and ops whose usual ONNX form onnx-mlir rejects (e.g. MaxPool's
Indices output, SoftmaxCrossEntropyLoss) with ops that it accepts.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import torch
from torch._decomp import core_aten_decompositions

LOWERINGS: dict[torch._ops.OpOverload, Callable] = {}


def lowers(*ops: torch._ops.OpOverload):
    """Register ``fn`` as bridge's decomposition of each ATen overload in ``ops``."""

    def register(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn

    return register


def decomposition_table() -> dict:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    table = dict(core_aten_decompositions())
    table.update(LOWERINGS)
    return table
