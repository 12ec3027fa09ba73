"""One training graph, any batch size: symbolic batch end to end, checked against torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, torch_steps
from onnx import TensorProto, helper, numpy_helper

import bridge

EXAMPLE = "examples/models/mlp.onnx"


def _batch_dims(tm: bridge.TrainingModel) -> dict[str, list]:
    return {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in tm.model.graph.input
        if i.name in tm.data_inputs + ["target"]
    }


def _example_twin(params, inputs):
    hidden = torch.relu(inputs["features"] @ params["fc1.weight"].T + params["fc1.bias"])
    return hidden @ params["fc2.weight"].T + params["fc2.bias"]


@pytest.fixture(scope="module")
def dynamic_model() -> bridge.TrainingModel:
    return bridge.to_training_onnx(EXAMPLE, loss="ce", optim="adam", optim_options={"lr": 0.01})


def test_symbolic_batch_is_the_default_for_a_symbolic_model(dynamic_model):
    assert _batch_dims(dynamic_model) == {"features": ["batch", 8], "target": ["batch"]}


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_one_file_trains_at_any_batch(dynamic_model, batch):
    rng = np.random.default_rng(batch)
    batches = [
        ({"features": rng.standard_normal((batch, 8)).astype(np.float32)}, rng.integers(0, 3, batch))
        for _ in range(2)
    ]
    weights = {w: dynamic_model.initial_state()[w] for w in dynamic_model.weights}
    want = torch_steps(_example_twin, weights, F.cross_entropy, torch.optim.Adam, {"lr": 0.01}, batches)
    assert_steps_match(bridge_steps(dynamic_model, batches), want)


def test_dynamic_batch_false_keeps_static_shapes():
    tm = bridge.to_training_onnx(EXAMPLE, loss="ce", dynamic_batch=False, batch_size=5)
    assert _batch_dims(tm) == {"features": [5, 8], "target": [5]}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_reductions_at_two_batch_sizes(reduction):
    tm = bridge.to_training_onnx(EXAMPLE, loss="mse", loss_options={"reduction": reduction}, optim_options={"lr": 0.01})
    weights = {w: tm.initial_state()[w] for w in tm.weights}
    for batch in (2, 7):
        rng = np.random.default_rng(batch)
        batches = [({"features": rng.standard_normal((batch, 8)).astype(np.float32)},
                    rng.standard_normal((batch, 3)).astype(np.float32))]
        loss = lambda out, tgt: F.mse_loss(out, tgt, reduction=reduction)  # noqa: E731
        assert_steps_match(bridge_steps(tm, batches), torch_steps(_example_twin, weights, loss, torch.optim.SGD, {"lr": 0.01}, batches))


def test_ce_with_every_label_ignored_matches_torch():
    """torch gives NaN loss (0/0) and zero... gradients; bridge must do the same."""
    tm = bridge.to_training_onnx(EXAMPLE, loss="ce", loss_options={"ignore_index": -1})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    target = np.full(4, -1, dtype=np.int64)
    out = tm.session(on_nonfinite="ignore").step({"features": x}, target)
    params = {w: torch.tensor(tm.initial_state()[w], requires_grad=True) for w in tm.weights}
    loss = F.cross_entropy(_example_twin(params, {"features": torch.tensor(x)}), torch.tensor(target), ignore_index=-1)
    loss.backward()
    np.testing.assert_array_equal(np.isnan(out["loss"]), np.isnan(loss.detach().numpy()))
    for name, param in params.items():
        np.testing.assert_array_equal(np.isnan(out[f"grad_{name}"]), np.isnan(param.grad.numpy()))


def _fixed_batch_reshape_model():
    """x [2, 3, 4] -> Reshape to the hard-coded [2, 12] -> MatMul: the batch is baked in."""
    w = np.random.default_rng(0).standard_normal((12, 5)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["flat"], name="flatten_hardcoded"),
            helper.make_node("MatMul", ["flat", "W"], ["y"], name="fc"),
        ],
        "fixed_batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array([2, 12], np.int64), "shape")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_hard_coded_batch_is_reported_with_its_node():
    with pytest.raises(bridge.ShapeError, match="flatten_hardcoded"):
        bridge.to_training_onnx(_fixed_batch_reshape_model(), dynamic_batch=True)


def test_fixed_batch_model_made_dynamic_where_the_graph_allows():
    """A fixed-batch model whose shapes all derive from the input becomes batch-agnostic."""
    model = _fixed_batch_reshape_model()
    model.graph.node[0].CopyFrom(helper.make_node("Flatten", ["x"], ["flat"], name="flatten", axis=1))
    tm = bridge.to_training_onnx(model, loss="mse", dynamic_batch=True)
    assert _batch_dims(tm)["x"] == ["batch", 3, 4]
    w = tm.initial_state()["W"]
    for batch in (1, 6):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 4)).astype(np.float32)
        target = np.zeros((batch, 5), np.float32)
        out = tm.session().step({"x": x}, target)
        weight = torch.tensor(w, requires_grad=True)
        loss = F.mse_loss(torch.tensor(x).reshape(batch, 12) @ weight, torch.tensor(target))
        loss.backward()
        np.testing.assert_allclose(out["loss"], loss.detach().numpy(), rtol=1e-5)
        np.testing.assert_allclose(out["grad_W"], weight.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_castlike_of_a_constant_traces_at_a_symbolic_batch():
    """A constant CastLike'd to a symbolic-batch tensor (dynamo exports emit these) is cast at import;
    it used to call ``.numpy()`` on a tracing tensor and refuse the symbolic batch."""
    weight = np.arange(3, dtype=np.float32) / 4
    nodes = [helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2, np.int64))),
             helper.make_node("CastLike", ["two", "x"], ["two_f"]),
             helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Add", ["xw", "two_f"], ["y"])]
    graph = helper.make_graph(nodes, "castlike", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(weight, "w")])
    tm = bridge.to_training_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                 loss="mse", optim="sgd", optim_options={"lr": 0.1})
    assert isinstance(_batch_dims(tm)["x"][0], str)  # symbolic
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    target = np.zeros((5, 3), np.float32)
    got = tm.session().step({"x": x}, target)
    expected = 2 * np.mean((x * weight + 2.0) * x, axis=0) / 3  # d/dw of mean((x w + 2)^2) over N x 3
    np.testing.assert_allclose(got["grad_w"], expected, rtol=1e-5)
