"""Checks shared by the convolution and pooling tests: the importer's forward against
onnxruntime, and the structural promises of the exported training graph."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import torch

import bridge
from helpers.importer import importer_and_onnxruntime
from helpers.reference import assert_close_to_scale


def assert_forward_matches_onnxruntime(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], rtol: float = 1e-5) -> None:
    """bridge's interpretation of the inference model equals onnxruntime's (ONNX semantics)."""
    ((got, want),) = importer_and_onnxruntime(model, feed)
    assert_close_to_scale(got, want, rtol)


def innermost_moves(graph: torch.fx.GraphModule) -> list[tuple]:
    """(op, output shape) of each copy in a traced lowering whose innermost axis holds fewer than
    8 elements: onnxruntime runs such a Transpose, Pad, Slice or Concat element by element."""
    aten = torch.ops.aten
    moves = {aten.permute.default, aten.constant_pad_nd.default, aten.slice.Tensor, aten.cat.default}
    return [(node.target, tuple(node.meta["val"].shape)) for node in graph.graph.nodes
            if node.target in moves and node.meta["val"].shape[-1] < 8]


def assert_onnx_mlir_clean(model: onnx.ModelProto) -> None:
    """No op outside onnx-mlir's table, no ConvTranspose with a computed weight, no MaxPool Indices."""
    assert bridge.check(model, target="onnx-mlir", compile=False) == []
    initializers = {init.name for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "ConvTranspose":
            assert node.input[1] in initializers, f"{node.name}: ConvTranspose weight is computed"
        if node.op_type == "MaxPool":
            assert len([o for o in node.output if o]) == 1, f"{node.name}: MaxPool with Indices"
