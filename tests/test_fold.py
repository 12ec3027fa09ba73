"""Constant folding on the traced step (bridge/pipeline/fold.py): values computed from constants only become
constants where every runtime computes them to the same bits; the steps stay the same bit for bit."""
from __future__ import annotations

import numpy as np
import torch
from helpers.models import _float_model
from onnx import TensorProto, helper, numpy_helper
from torch.fx.experimental.proxy_tensor import make_fx

import bridge
import bridge.pipeline.trace
from bridge.pipeline.cse import eliminate_dead_code
from bridge.pipeline.fold import fold_constants


def _with_constants(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    index = torch.tensor([0, -1, 2])
    wrapped = torch.where(index < 0, index + 3, index)  # integer arithmetic on a constant: folded
    scale = torch.tensor([0.1, 0.2, 0.3]) * 3.0  # float arithmetic: left to the runtime
    grown = torch.tensor([1, 2]).expand(4, 2)  # larger than the constant it reads: left as it is
    return x.index_select(0, wrapped) * scale, grown + x.shape[0], wrapped.reshape(3, 1)


def test_integer_values_of_constants_fold_and_float_arithmetic_and_growth_stay():
    x = torch.randn(3)
    graph_module = make_fx(_with_constants)(x)
    assert fold_constants(graph_module) > 0
    eliminate_dead_code(graph_module.graph)
    graph_module.recompile()
    computed = {node.target for node in graph_module.graph.nodes if node.op == "call_function"}
    aten = torch.ops.aten
    assert not computed & {aten.lt.Scalar, aten.where.self, aten.view.default}
    assert {aten.mul.Tensor, aten.expand.default} <= computed
    for got, want in zip(graph_module(x), _with_constants(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _position_embedding_model():
    """Token embeddings plus position embeddings gathered at constant position ids (as BERT's)."""
    rng = np.random.default_rng(0)
    weights = {"tokens": rng.standard_normal((10, 4)).astype(np.float32),
               "positions": rng.standard_normal((6, 4)).astype(np.float32)}
    ids = numpy_helper.from_array(np.array([[0, 1, 2, -1]], np.int64), "position_ids")
    nodes = [helper.make_node("Constant", [], ["position_ids"], value=ids),
             helper.make_node("Gather", ["tokens", "ids"], ["t"], name="token_gather"),
             helper.make_node("Gather", ["positions", "position_ids"], ["p"], name="position_gather"),
             helper.make_node("Add", ["t", "p"], ["y"], name="add")]
    model = _float_model("positions", nodes, ("ids", [2, 4]), ("y", [2, 4, 4]), weights, 17)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64
    return model


def test_constant_position_ids_are_not_wrapped_at_every_step_and_steps_are_bit_identical(monkeypatch):
    """The position ids' wrap of negative indices (forward and the gradient's scatter) is folded; the token ids
    (data) are wrapped in the graph."""
    model = _position_embedding_model()
    folded = bridge.to_training_onnx(model, loss="mse", optim="adam")
    monkeypatch.setattr(bridge.pipeline.trace, "fold_constants", lambda graph_module: 0)
    plain = bridge.to_training_onnx(model, loss="mse", optim="adam")

    def wraps(tm: bridge.TrainingModel) -> set[str]:
        return {node.layer for node in bridge.ir.load(tm.model).nodes() if node.op_type == "Less"}

    assert wraps(plain) == {"token_gather", "position_gather"}
    assert wraps(folded) == {"token_gather"}
    rng = np.random.default_rng(1)
    sessions = folded.session(), plain.session()
    for _ in range(3):
        ids, target = rng.integers(-10, 10, (2, 4)), rng.standard_normal((2, 4, 4)).astype(np.float32)
        a, b = (session.step({"ids": ids}, target) for session in sessions)
        assert a.keys() == b.keys()
        for key in a:
            assert np.array_equal(a[key], b[key]), key
