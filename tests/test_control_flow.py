"""Control flow resolved at import (bridge/pipeline/importer/ops/control_flow.py): an RNN written as an ONNX
Loop (and as a Scan) trains like the same recurrence in torch; a constant If folds to its
branch; what cannot be decided before the model runs is refused with an error naming the node."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, random_batches, torch_steps
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.errors import ShapeError
from bridge.pipeline.importer.ops import control_flow

BATCH, STEPS, FEATURES, HIDDEN = 3, 5, 4, 6
LR = 0.1


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"W0": (FEATURES, HIDDEN), "W": (FEATURES, HIDDEN), "U": (HIDDEN, HIDDEN), "b": (HIDDEN,)}
    return {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def _cell(x_t: str, h: str, out: str, prefix: str) -> list[onnx.NodeProto]:
    """``out = tanh(x_t @ W + h @ U + b)`` (W, U, b read from the enclosing graph)."""
    return [
        helper.make_node("MatMul", [x_t, "W"], [f"{prefix}xw"], name=f"{prefix}xw"),
        helper.make_node("MatMul", [h, "U"], [f"{prefix}hu"], name=f"{prefix}hu"),
        helper.make_node("Add", [f"{prefix}xw", f"{prefix}hu"], [f"{prefix}s"], name=f"{prefix}add"),
        helper.make_node("Add", [f"{prefix}s", "b"], [f"{prefix}z"], name=f"{prefix}bias"),
        helper.make_node("Tanh", [f"{prefix}z"], [out], name=f"{prefix}tanh"),
    ]


def _model(recurrence: list[onnx.NodeProto], extra: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """x [B, T, F] -> h0 = tanh(x[:, 0] @ W0) -> ``recurrence`` (hs [T, B, H]) -> y [B, T, H]."""
    nodes = [
        helper.make_node("Gather", ["x", "zero"], ["x0"], axis=1, name="first"),
        helper.make_node("MatMul", ["x0", "W0"], ["p0"], name="init"),
        helper.make_node("Tanh", ["p0"], ["h0"], name="init_tanh"),
        *recurrence,
        helper.make_node("Transpose", ["hs"], ["y"], perm=[1, 0, 2], name="batch_first"),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in _weights().items()]
    inits += [numpy_helper.from_array(np.asarray(0, np.int64), "zero"), *extra]
    graph = helper.make_graph(nodes, "rnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, STEPS, FEATURES])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, STEPS, HIDDEN])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _scalar_info(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, [])


def loop_rnn(trip_count: int = STEPS, cond_nodes: list[onnx.NodeProto] | None = None) -> onnx.ModelProto:
    """The tanh RNN as a Loop: the body slices x at the iteration number, carries h and scans it
    (``cond_nodes`` compute the body's ``cond_out``, default: the incoming condition)."""
    hidden = helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [BATCH, HIDDEN])
    body = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["x_t"], axis=1, name="slice_t"),
         *_cell("x_t", "h_in", "h_out", "cell_"),
         *(cond_nodes or [helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep_going")]),
         helper.make_node("Identity", ["h_out"], ["h_scan"], name="scan_out")],
        "body", [_scalar_info("i", TensorProto.INT64), _scalar_info("cond_in", TensorProto.BOOL), hidden],
        [_scalar_info("cond_out", TensorProto.BOOL),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [BATCH, HIDDEN]),
         helper.make_tensor_value_info("h_scan", TensorProto.FLOAT, [BATCH, HIDDEN])])
    loop = helper.make_node("Loop", ["M", "cond", "h0"], ["h_last", "hs"], body=body, name="rnn_loop")
    extra = [numpy_helper.from_array(np.asarray(trip_count, np.int64), "M"),
             numpy_helper.from_array(np.asarray(True), "cond")]
    return _model([loop], extra)


def scan_rnn() -> onnx.ModelProto:
    """The same RNN as a Scan over axis 1 of x (batch first), scan output stacked on axis 0."""
    body = helper.make_graph(
        [*_cell("x_t", "h_in", "h_out", "cell_"), helper.make_node("Identity", ["h_out"], ["h_scan"], name="scan_out")],
        "body", [helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [BATCH, HIDDEN]),
                 helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [BATCH, FEATURES])],
        [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [BATCH, HIDDEN]),
         helper.make_tensor_value_info("h_scan", TensorProto.FLOAT, [BATCH, HIDDEN])])
    scan = helper.make_node("Scan", ["h0", "x"], ["h_last", "hs"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], name="rnn_scan")
    return _model([scan])


def torch_rnn(params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    x = inputs["x"]
    h = torch.tanh(x[:, 0] @ params["W0"])
    outputs = []
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ params["W"] + h @ params["U"] + params["b"])
        outputs.append(h)
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("build", [loop_rnn, pytest.param(scan_rnn, marks=pytest.mark.exhaustive)], ids=["loop", "scan"])
def test_rnn_trains_like_torch(build):
    tm = bridge.to_training_onnx(build(), loss="mse", optim="sgd", optim_options={"lr": LR})
    assert sorted(tm.weights) == ["U", "W", "W0", "b"]
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    batches = random_batches(tm, 3)
    want = torch_steps(torch_rnn, _weights(), F.mse_loss, torch.optim.SGD, {"lr": LR}, batches)
    assert_steps_match(bridge_steps(tm, batches), want)


@pytest.mark.exhaustive  # op_db's Loop row covers a symbolic batch in the default tier
def test_loop_rnn_trains_at_any_batch_size():
    tm = bridge.to_training_onnx(loop_rnn(), dynamic_batch=True)
    x = np.random.default_rng(1).standard_normal((5, STEPS, FEATURES)).astype(np.float32)
    target = np.zeros((5, STEPS, HIDDEN), np.float32)
    want = F.mse_loss(torch_rnn({k: torch.tensor(v) for k, v in _weights().items()}, {"x": torch.tensor(x)}),
                      torch.tensor(target))
    got = tm.session().step({"x": x}, target)["loss"]
    np.testing.assert_allclose(got, want.item(), rtol=1e-5)


def _if_model(cond) -> onnx.ModelProto:
    """y = If(cond, then: x @ W, else: x @ U) with W, U read from the outer scope."""
    def branch(weight: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node("MatMul", ["x", weight], [f"y_{weight}"], name=f"mm_{weight}")],
                                 f"branch_{weight}", [], [helper.make_tensor_value_info(f"y_{weight}", TensorProto.FLOAT, None)])
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), n) for n in ("W", "U")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    if cond is None:  # computed from data
        nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, name="total"),
                 helper.make_node("Greater", ["total", "zero"], ["cond"], name="positive")]
        inits.append(numpy_helper.from_array(np.asarray(0.0, np.float32), "zero"))
    else:
        nodes = [helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.asarray(cond)), name="flag")]
    nodes.append(helper.make_node("If", ["cond"], ["y"], then_branch=branch("W"), else_branch=branch("U"), name="choose"))
    graph = helper.make_graph(nodes, "if", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cond, trained", [(True, "W"), (False, "U")])
def test_constant_if_folds_to_its_branch(cond, trained):
    tm = bridge.to_training_onnx(_if_model(cond))
    assert tm.weights == [trained]
    assert "If" not in {n.op_type for n in tm.model.graph.node}


def test_data_dependent_if_is_refused():
    with pytest.raises(ShapeError, match="If node 'choose'.*computed from data"):
        bridge.to_training_onnx(_if_model(None))


def test_loop_past_the_unroll_bound_is_refused(monkeypatch):
    monkeypatch.setattr(control_flow, "MAX_UNROLL", STEPS - 1)
    with pytest.raises(ShapeError, match=f"Loop node 'rnn_loop': {STEPS} iterations exceed .* {STEPS - 1}"):
        bridge.to_training_onnx(loop_rnn())


def test_data_dependent_loop_condition_is_refused():
    """A body that stops when the hidden state's sum turns negative: undecidable at import."""
    zero = numpy_helper.from_array(np.asarray(0.0, np.float32))
    nodes = [helper.make_node("ReduceSum", ["h_out"], ["h_sum"], keepdims=0, name="h_sum"),
             helper.make_node("Constant", [], ["zero_f"], value=zero, name="zero_f"),
             helper.make_node("Greater", ["h_sum", "zero_f"], ["cond_out"], name="stop_test")]
    with pytest.raises(ShapeError, match="Loop node 'rnn_loop': the condition the body returns is computed from data"):
        bridge.to_training_onnx(loop_rnn(cond_nodes=nodes))


def test_traced_non_max_suppression_is_refused():
    """NMS's output size depends on the scores: evaluated by the importer, never traced for training."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["boxes"], name="box_head"),
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit"], ["selected"], name="nms")]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.random((1, 1, 6)).astype(np.float32), "scores"),
             numpy_helper.from_array(np.asarray([3], np.int64), "limit")]
    graph = helper.make_graph(nodes, "nms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 4])],
                              [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 6, 4]),
                               helper.make_tensor_value_info("selected", TensorProto.INT64, ["n", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ShapeError, match="NonMaxSuppression node 'nms': its output size depends on the box and score"):
        bridge.to_training_onnx(model)
