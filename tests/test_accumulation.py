"""Gradient accumulation: the step split into a gradient graph and an update graph (composing them
is the training graph, to the bit), k micro-batches accumulated vs one step on the concatenated
batch (torch is the oracle), BatchNorm statistics per micro-batch as in torch, the Trainer loop."""
from __future__ import annotations

import copy
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lifecycle_models import assert_close_to_float64, batch, features, small_cnn, small_mlp

import bridge
from bridge.pipeline.annotate import PHASE, ROLE, props
from bridge.training.runtime import OrtGraph
from bridge.training.training_model import part_path

MICRO = [3, 5, 4, 4]  # micro-batch sizes of one effective batch of 16 (unequal on purpose)
LR = {"sgd": 0.1, "adam": 0.01}
CLIP = 0.5  # below the gradient norm of the first steps, so clipping changes the update


@pytest.fixture(scope="module")
def mlp_models():
    """small_mlp converted with SGD (momentum) and with Adam, both clipping by global norm."""
    module, model = small_mlp()
    options = {"sgd": {"lr": LR["sgd"], "momentum": 0.9}, "adam": {"lr": LR["adam"]}}
    return module, {name: bridge.to_training_onnx(model, loss="ce", optim=name, optim_options=options[name],
                                                  clip_grad_norm=CLIP, extra_outputs=True)
                    for name in options}


@pytest.fixture(scope="module")
def cnn():
    module, model = small_cnn()
    return module, bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.01})


def _micro_batches(seed: int) -> list[tuple[dict, np.ndarray]]:
    return [({"x": x}, y) for x, y in (features(size, seed=seed + i) for i, size in enumerate(MICRO))]


def _concatenated(micro: list[tuple[dict, np.ndarray]]) -> tuple[dict, np.ndarray]:
    return {"x": np.concatenate([m[0]["x"] for m in micro])}, np.concatenate([m[1] for m in micro])


# -- the split graphs ----------------------------------------------------------------------------

def _compose(tm, state: dict, inputs: dict, target: np.ndarray) -> dict:
    """The gradient graph, then the update graph on its gradients."""
    gradient = OrtGraph(tm.gradient_model)({**state, **inputs, "target": target})
    update = OrtGraph(tm.update_model)({**state, **{k: v for k, v in gradient.items() if k.startswith("grad_")}})
    return {**gradient, **update}


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_gradient_then_update_graph_is_the_training_graph_bit_for_bit(mlp_models, optim):
    _, models = mlp_models
    tm = models[optim]
    step = OrtGraph(tm.model)
    state = tm.initial_state()
    for seed in range(3):  # a few steps, so the optimizer state is not the initial one
        x, target = features(7, seed=seed)
        inputs = {"x": x}
        want = step({**state, **inputs, "target": target})
        got = _compose(tm, state, inputs, target)
        assert set(want) == set(got)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        state.update({name[len("updated_"):]: value for name, value in want.items() if name.startswith("updated_")})


def test_split_with_batchnorm_and_dropout_is_the_training_graph(cnn):
    _, tm = cnn
    (noise_name,) = tm.signature.random
    inputs, target = batch(6, seed=1)
    inputs[noise_name] = np.random.default_rng(2).random((6, 4 * 36)).astype(np.float32)
    state = tm.initial_state()
    want = OrtGraph(tm.model)({**state, **inputs, "target": target})
    got = _compose(tm, state, inputs, target)
    assert set(got) == set(want) and "updated_bn.running_mean" in got
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_split_graphs_are_annotated_and_onnx_mlir_clean(mlp_models, cnn):
    for tm in [*mlp_models[1].values(), cnn[1]]:
        for graph, phases in ((tm.gradient_model, {"forward", "loss", "backward"}), (tm.update_model, {"optimizer"})):
            assert {props(n.metadata_props)[PHASE] for n in graph.graph.node} == phases
            assert bridge.check(graph, target="onnx-mlir", compile=False) == []
        roles = {v.name: props(v.metadata_props)[ROLE] for v in tm.update_model.graph.input}
        assert {roles[f"grad_{w}"] for w in tm.weights} == {"gradient"} and roles["lr"] == "hyperparameter"
        outputs = [v.name for v in tm.gradient_model.graph.output]
        assert outputs[:1 + len(tm.weights)] == ["loss"] + [f"grad_{w}" for w in tm.weights]


def test_save_writes_the_gradient_and_update_graphs_beside_the_training_graph(mlp_models, tmp_path):
    tm = mlp_models[1]["sgd"]
    path = tm.save(tmp_path / "mlp.onnx")
    tm.save_state(tmp_path / "mlp.state.npz")
    for part, graph in (("gradient", tm.gradient_model), ("update", tm.update_model)):
        assert part_path(path, part).read_bytes() == graph.SerializeToString()
    micro = _micro_batches(seed=30)
    from_files = bridge.Trainer(path, accumulation_steps=2).accumulate(micro)
    in_memory = bridge.Trainer(tm).accumulate(micro)
    assert from_files["loss"] == in_memory["loss"]


# -- accumulation vs one big batch ---------------------------------------------------------------

def _torch_big_batch_steps(module, optim: str, batches: list[tuple[dict, np.ndarray]], dtype) -> dict:
    """torch: one step per (concatenated) batch, clipping by global norm; the final weights and losses."""
    module = copy.deepcopy(module).to(dtype)
    if optim == "sgd":
        optimizer = torch.optim.SGD(module.parameters(), lr=LR["sgd"], momentum=0.9)
    else:
        optimizer = torch.optim.Adam(module.parameters(), lr=LR["adam"])
    losses = []
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(module(torch.from_numpy(inputs["x"]).to(dtype)), torch.from_numpy(target))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": np.array(losses), **{k: v.detach().numpy() for k, v in module.state_dict().items()}}


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_accumulated_micro_batches_equal_one_step_on_the_concatenated_batch(mlp_models, optim):
    module, models = mlp_models
    tm = models[optim]
    groups = [_micro_batches(seed=10), _micro_batches(seed=20)]  # two optimizer steps of 4 micro-batches
    accumulated, big = tm.session(), tm.session()
    accumulated.enable_accumulation(tm.gradient_model, tm.update_model)
    got = {"acc": [], "big": []}
    for micro in groups:
        got["acc"].append(float(accumulated.accumulate(micro)["loss"]))
        got["big"].append(float(big.step(*_concatenated(micro))["loss"]))
    want32, want64 = (_torch_big_batch_steps(module, optim, [_concatenated(m) for m in groups], d)
                      for d in (torch.float32, torch.float64))
    assert accumulated.state["step"] == 2
    assert_close_to_float64(np.array(got["acc"]), want32["losses"], want64["losses"])
    for name in tm.weights:
        assert_close_to_float64(accumulated.state[name], want32[name], want64[name])
        # and as close to the bridge big-batch step as float32 summation order allows
        np.testing.assert_allclose(accumulated.state[name], big.state[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_accumulated_outputs_are_the_micro_batches_concatenated(mlp_models):
    tm = mlp_models[1]["sgd"]
    session = tm.session()
    session.enable_accumulation(tm.gradient_model, tm.update_model)
    micro = _micro_batches(seed=40)
    results = session.accumulate(micro)  # output_y: the forward of each micro-batch before the update
    gradient = OrtGraph(tm.gradient_model)
    logits = np.concatenate([gradient({**tm.initial_state(), **i, "target": t})["output_y"] for i, t in micro])
    assert results["output_y"].shape[0] == sum(MICRO)
    np.testing.assert_array_equal(results["output_y"], logits)


def test_batchnorm_statistics_are_updated_per_micro_batch_as_in_torch(cnn):
    module, tm = cnn
    session = tm.session(seed=0)
    session.enable_accumulation(tm.gradient_model, tm.update_model)
    micro = [batch(size, seed=50 + i) for i, size in enumerate(MICRO)]
    session.accumulate(micro)
    twins = {dtype: copy.deepcopy(module).to(dtype).train() for dtype in (torch.float32, torch.float64)}
    with torch.no_grad():
        for dtype, twin in twins.items():
            for inputs, _ in micro:  # running statistics do not depend on Dropout (after BatchNorm)
                twin(torch.from_numpy(inputs["x"]).to(dtype))
    for name in ("bn.running_mean", "bn.running_var"):
        want32, want64 = (twins[d].state_dict()[name].numpy() for d in (torch.float32, torch.float64))
        assert_close_to_float64(session.state[name], want32, want64)


# -- the Trainer ---------------------------------------------------------------------------------

def test_trainer_fit_with_accumulation_equals_fit_with_the_big_batch(mlp_models):
    tm = mlp_models[1]["adam"]
    data = features(24, seed=60)
    accumulated = bridge.Trainer(tm, accumulation_steps=4)
    accumulated.fit(data, epochs=2, batch_size=3, shuffle=False)
    big = bridge.Trainer(tm)
    big.fit(data, epochs=2, batch_size=12, shuffle=False)
    assert len(accumulated.history.steps) == len(big.history.steps) == 4
    assert accumulated.history["samples"] == [24, 24] and "accuracy" in accumulated.history.epochs[0]
    np.testing.assert_allclose(accumulated.history["loss"], big.history["loss"], rtol=1e-5)
    for name in tm.weights:
        np.testing.assert_allclose(accumulated.session.state[name], big.session.state[name], rtol=1e-5, atol=1e-6)


def test_last_group_of_an_epoch_may_have_fewer_micro_batches(mlp_models):
    tm = mlp_models[1]["sgd"]
    trainer = bridge.Trainer(tm, accumulation_steps=3)
    trainer.fit(features(20, seed=70), epochs=1, batch_size=4)  # 5 micro-batches: groups of 3 and 2
    assert len(trainer.history.steps) == 2 and trainer.session.state["step"] == 2
    assert trainer.history["samples"] == [20]


def test_accumulation_options_and_missing_graphs_are_refused(mlp_models, tmp_path):
    tm = mlp_models[1]["sgd"]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(bridge.InvalidOptionError, match="accumulation_steps="):
            bridge.Trainer(tm, accumulation_steps=bad)
    path = tmp_path / "alone.onnx"
    bridge.training.training_model.save_atomically(tm.model, path)
    with pytest.raises(bridge.InvalidOptionError, match="needs the gradient and update graphs"):
        bridge.Trainer(path, state=tm.initial_state(), accumulation_steps=2)
    with pytest.raises(bridge.BridgeError, match="enable_accumulation"):
        tm.session().accumulate(_micro_batches(seed=0))
    session = tm.session()
    session.enable_accumulation(tm.gradient_model, tm.update_model)
    with pytest.raises(bridge.BridgeError, match="at least one micro-batch"):
        session.accumulate([])
    with pytest.raises(bridge.StepInputError):
        session.accumulate([({"x": np.zeros((2, 5), np.float32)}, np.zeros(2, np.int64))])
    assert session.state["step"] == 0


# -- command line and plot -----------------------------------------------------------------------

def test_cli_train_with_accumulation_and_plot(tmp_path):
    from bridge.cli import main

    _, model = small_mlp()
    source, train = tmp_path / "mlp.onnx", tmp_path / "train.onnx"
    source.write_bytes(model.SerializeToString())
    assert main(["convert", str(source), "-o", str(train), "--loss", "ce", "--optim", "sgd",
                 "--optim-options", '{"lr": 0.1}', "--clip-grad-norm", str(CLIP)]) == 0
    assert part_path(train, "gradient").is_file() and part_path(train, "update").is_file()
    x, y = features(20, seed=80)
    np.savez(tmp_path / "data.npz", x=x, target=y)
    plot = tmp_path / "curves.png"
    assert main(["train", str(train), "--data", str(tmp_path / "data.npz"), "--batch-size", "4", "--epochs", "2",
                 "--accumulation-steps", "5", "--checkpoint", str(tmp_path / "run.npz"), "--plot", str(plot)]) == 0
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    same = bridge.Trainer(train, accumulation_steps=5)
    same.fit((x, y), epochs=2, batch_size=4)
    resumed = bridge.Trainer(train)
    resumed.load_checkpoint(tmp_path / "run.npz")
    assert len(resumed.history.steps) == 2  # one optimizer step per epoch: 5 micro-batches of 4
    for name in same.session.state:
        np.testing.assert_array_equal(resumed.session.state[name], same.session.state[name], err_msg=name)


def test_plot_without_matplotlib_is_a_clear_error(mlp_models, tmp_path, monkeypatch):
    from bridge.training.plot import MissingDependencyError, plot_history

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trainer = bridge.Trainer(mlp_models[1]["sgd"])
    with pytest.raises(MissingDependencyError, match="pip install matplotlib"):
        plot_history({"bridge": trainer.history}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
