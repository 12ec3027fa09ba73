"""Dropout in training: the mask comes from the graph input ``<node>.noise``; with the same mask
torch gives the same loss, grads and updates, and the runtime draws fresh noise every step."""
from __future__ import annotations

import io
import json

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import seed_of
from helpers.reference import assert_steps_match, bridge_steps, torch_steps
from helpers.single_op import one_node_model, train_and_compare

import bridge

rng = np.random.default_rng(11)  # re-seeded for each test from its id (tests/conftest.py)
SHAPE = (3, 4, 5)


def _dropout_model(opset: int, ratio: float, outputs: int = 1) -> onnx.ModelProto:
    pre = rng.standard_normal(SHAPE)
    if opset >= 12:
        return one_node_model("Dropout", ["x", "ratio"], {"x": np.zeros(SHAPE)}, {"ratio": np.asarray(ratio, np.float32)},
                              opset, outputs=outputs, name="drop", out_shape=SHAPE, prescale=pre)
    return one_node_model("Dropout", ["x"], {"x": np.zeros(SHAPE)}, {}, opset, outputs=outputs, name="drop",
                          out_shape=SHAPE, prescale=pre, ratio=ratio)


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 22])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.75])
@pytest.mark.parametrize("outputs", [1, 2], ids=["y", "y_mask"])
def test_dropout_with_given_noise_matches_torch(opset, ratio, outputs):
    model = _dropout_model(opset, ratio, outputs)
    pre = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w_pre"))
    p = float(np.float32(ratio))  # ONNX ratio is a float32
    batches = [({"x": rng.standard_normal(SHAPE), "drop.noise": rng.random(SHAPE)}, rng.standard_normal(SHAPE))
               for _ in range(2)]

    def twin(params, inputs):
        keep = (inputs["drop.noise"] >= p).to(torch.float64)
        return inputs["x"] * params["w_pre"] * keep / (1 - p)

    tm, _ = train_and_compare(model, {"w_pre": pre}, twin, batches, steps_rtol=1e-9)
    assert tm.signature.random == ["drop.noise"]
    noise = next(i for i in tm.model.graph.input if i.name == "drop.noise")
    assert {p.key: p.value for p in noise.metadata_props}["bridge.role"] == "random"
    assert [d.dim_value for d in noise.type.tensor_type.shape.dim] == list(SHAPE)
    assert json.loads({p.key: p.value for p in tm.model.metadata_props}["bridge.random_inputs"]) == ["drop.noise"]
    assert not {n.op_type for n in tm.model.graph.node} & {"Dropout", "RandomUniform", "RandomUniformLike", "Bernoulli"}


def test_runtime_draws_fresh_noise_each_step():
    model = _dropout_model(13, 0.5)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.0})
    session = tm.session(seed=0)
    x, target = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    grads = [session.step({"x": x}, target)["grad_w_pre"] for _ in range(3)]
    kept = [np.mean(g != 0) for g in grads]
    assert not np.array_equal(grads[0], grads[1]) and not np.array_equal(grads[1], grads[2])
    assert all(0.25 < k < 0.75 for k in kept), kept  # 60 elements, keep probability 0.5


def test_ratio_zero_needs_no_noise():
    model = _dropout_model(13, 0.0)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd")
    assert tm.signature.random == []


def test_torch_training_mode_export_matches_torch_dropout():
    """A model exported in training mode (Dropout with training_mode=True); torch's own
    F.dropout mask (from its RNG) is handed to bridge as noise (1 where kept, 0 where dropped)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Dropout(0.25), torch.nn.Linear(8, 3))
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(4, 6),), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["x"], output_names=["y"])
    source = onnx.load_from_string(buffer.getvalue())
    drop = next(n for n in source.graph.node if n.op_type == "Dropout")
    tm = bridge.to_training_onnx(source, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    assert tm.signature.random == [f"{drop.name}.noise"]

    seeds = [3, 4]
    masks = []
    for seed in seeds:
        torch.manual_seed(seed)
        masks.append(F.dropout(torch.ones(4, 8), 0.25, training=True) != 0)
    batches = [({"x": rng.standard_normal((4, 6)).astype(np.float32), f"{drop.name}.noise": mask.numpy().astype(np.float32)},
                rng.standard_normal((4, 3)).astype(np.float32)) for mask in masks]
    weights = {n: p.detach().numpy() for n, p in module.named_parameters()}
    calls = iter(seeds)

    def forward(params, inputs):
        torch.manual_seed(next(calls))  # the same draw as the mask above
        return torch.func.functional_call(module.train(), params, (inputs["x"],))

    want = torch_steps(forward, weights, F.mse_loss, torch.optim.SGD, {"lr": 0.125}, batches)
    assert_steps_match(bridge_steps(tm, batches), want)


def test_draws_do_not_depend_on_the_tests_run_before(request):
    """The module generator this file draws from is seeded per test (tests/conftest.py): pytest-xdist
    hands tests to workers in a different order each run, and a shared generator would give a test
    different data each time."""
    drawn = rng.standard_normal(4)
    assert np.array_equal(drawn, np.random.default_rng(seed_of(request.node)).standard_normal(4))
