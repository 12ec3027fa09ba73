"""Tiny one-node ONNX models and a one-call "train it in bridge and in torch, compare" check.

Used by the per-op tests of normalization, embedding, resize and dropout: a model is one ONNX
node whose trainable inputs are initializers; the torch twin is a function of the same
weights written with torch.nn.functional (never with bridge's code).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

import bridge
from bridge.pipeline.targets import DEFAULT_TARGET
from helpers.reference import assert_steps_match, bridge_steps, torch_steps

ELEM = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float64): onnx.TensorProto.DOUBLE,
        np.dtype(np.int64): onnx.TensorProto.INT64, np.dtype(np.bool_): onnx.TensorProto.BOOL}


def one_node_model(op_type: str, node_inputs: Sequence[str], data: Mapping[str, np.ndarray],
                   initializers: Mapping[str, np.ndarray], opset: int, outputs: int = 1,
                   name: str = "node", out_dtype=None, out_shape=None, prescale: np.ndarray | None = None,
                   **attrs) -> onnx.ModelProto:
    """A model with one ``op_type`` node; ``data`` are graph inputs (their values give shape and
    dtype); outputs have ``out_dtype`` (default: the first data input's) and ``out_shape`` (default:
    from ONNX shape inference). ``prescale`` (an
    initializer ``w_pre``) multiplies the first node input first, for ops without weights."""
    out_names = ["y"] + [f"extra{i}" for i in range(1, outputs)]
    nodes = [helper.make_node(op_type, list(node_inputs), out_names, name=name, **attrs)]
    initializers = dict(initializers)
    if prescale is not None:
        initializers["w_pre"] = prescale
        nodes.insert(0, helper.make_node("Mul", [node_inputs[0], "w_pre"], ["pre"], name="pre"))
        nodes[1].input[0] = "pre"
    inputs = [helper.make_tensor_value_info(k, ELEM[v.dtype], v.shape) for k, v in data.items()]
    out_dtype = np.dtype(out_dtype or next(iter(data.values())).dtype)
    outs = [helper.make_tensor_value_info(n, ELEM[out_dtype], out_shape) for n in out_names]
    graph = helper.make_graph(nodes, op_type.lower(), inputs, outs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 17 else 10
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    return model


def train_and_compare(model: onnx.ModelProto, weights: Mapping[str, np.ndarray],
                      twin: Callable[[dict, dict], torch.Tensor], batches: list, *, steps_rtol: float,
                      loss: str = "mse", lr: float = 0.125, trainable=None,
                      target: str = DEFAULT_TARGET, **options) -> tuple[bridge.TrainingModel, list[dict]]:
    """Convert ``model`` (``options``: more ``to_training_onnx`` arguments), run ``len(batches)`` SGD steps in
    onnxruntime and in torch, compare (``lr`` defaults to a power of two: the ``lr`` input is float32 even for
    float64 weights) loss, grads and updated weights, and check that onnx-mlir accepts the training graph
    (converted for ``target``); returns the training model and bridge's step outputs."""
    tm = bridge.to_training_onnx(model, loss=loss, optim="sgd", optim_options={"lr": lr}, trainable=trainable,
                                 target=target, **options)
    assert sorted(tm.weights) == sorted(weights)
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    torch_loss = {"mse": F.mse_loss, "ce": F.cross_entropy}[loss]
    want = torch_steps(twin, weights, torch_loss, torch.optim.SGD, {"lr": lr}, batches)
    got = bridge_steps(tm, batches)
    assert_steps_match(got, want, rtol=steps_rtol)
    return tm, got


def batches_for(shapes: Mapping[str, tuple], target_shape: tuple, count: int, dtype=np.float64, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [({k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()},
             rng.standard_normal(target_shape).astype(dtype)) for _ in range(count)]
