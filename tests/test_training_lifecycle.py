"""The training lifecycle around the step: the eval graph, extra outputs of the step, step-time
checks, checkpoints and the way back to an inference model. torch is the oracle throughout."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from lifecycle_models import assert_close_to_float64, batch, load_state, small_cnn

import bridge
from bridge.pipeline.annotate import PHASE, ROLE, props
from bridge.training.runtime import OrtGraph
from bridge.training.training_model import eval_path


@pytest.fixture(scope="module")
def cnn():
    module, model = small_cnn()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.01}, extra_outputs=True)
    return module, model, tm


def _torch_eval(module: torch.nn.Module, inputs: dict, target: np.ndarray, dtype: torch.dtype):
    """torch ``model.eval()``: the logits and the cross-entropy, in ``dtype``."""
    module = copy.deepcopy(module).to(dtype).eval()
    with torch.no_grad():
        logits = module(torch.from_numpy(inputs["x"]).to(dtype))
        loss = F.cross_entropy(logits, torch.from_numpy(target))
    return logits.numpy(), loss.numpy()


def _assert_eval_matches_torch(session, module, inputs, target):
    got = session.evaluate(inputs, target)
    (y32, loss32), (y64, loss64) = (_torch_eval(module, inputs, target, d) for d in (torch.float32, torch.float64))
    assert_close_to_float64(got["output_y"], y32, y64)
    assert_close_to_float64(got["loss"], loss32, loss64)


# -- 1. eval graph -------------------------------------------------------------------------------

def test_eval_graph_matches_torch_eval_mode_before_and_after_training(cnn):
    module, _, tm = cnn
    session = tm.session(seed=0)
    inputs, target = batch(7, seed=1)
    _assert_eval_matches_torch(session, module, inputs, target)
    for step in range(3):
        session.step(*batch(6, seed=10 + step))
    assert not np.allclose(session.state["bn.running_mean"], tm.initial_values["bn.running_mean"])
    trained = load_state(copy.deepcopy(module), session.state)
    _assert_eval_matches_torch(session, trained, inputs, target)


def test_eval_graph_is_inference_only_annotated_and_onnx_mlir_clean(cnn):
    _, _, tm = cnn
    graph = tm.eval_model.graph
    assert {props(n.metadata_props)[PHASE] for n in graph.node} == {"forward", "loss"}
    roles = {v.name: props(v.metadata_props)[ROLE] for v in list(graph.input) + list(graph.output)}
    assert roles == {**{w: "weight" for w in tm.weights}, "bn.running_mean": "buffer", "bn.running_var": "buffer",
                     "x": "input", "target": "target", "loss": "loss", "output_y": "output"}
    assert bridge.check(tm.eval_model, target="onnx-mlir", compile=False) == []
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    assert bridge.ir.load(tm.eval_model).loss == "loss"


def test_eval_graph_is_deterministic_dropout_off(cnn):
    _, _, tm = cnn
    session = tm.session()
    inputs, target = batch(4, seed=2)
    first, second = session.evaluate(inputs, target), session.evaluate(inputs, target)
    np.testing.assert_array_equal(first["output_y"], second["output_y"])


def test_save_writes_the_eval_graph_beside_the_training_graph(cnn, tmp_path):
    _, _, tm = cnn
    path = tm.save(tmp_path / "cnn.onnx")
    assert eval_path(path) == tmp_path / "cnn.eval.onnx"
    assert onnx.load(str(eval_path(path))).SerializeToString() == tm.eval_model.SerializeToString()


# -- 2. extra outputs ----------------------------------------------------------------------------

def test_extra_output_is_the_training_mode_forward_of_torch(cnn):
    module, _, tm = cnn
    (noise_name,) = tm.signature.random
    inputs, target = batch(6, seed=3)
    noise = np.random.default_rng(4).random((6, module.fc.in_features)).astype(np.float32)
    got = tm.session().step({**inputs, noise_name: noise}, target)
    results = {}
    for dtype in (torch.float32, torch.float64):
        twin = copy.deepcopy(module).to(dtype).train()
        twin.mask = torch.from_numpy(noise >= 0.5).to(dtype)
        with torch.no_grad():
            logits = twin(torch.from_numpy(inputs["x"]).to(dtype))
        results[dtype] = (logits.numpy(), F.cross_entropy(logits, torch.from_numpy(target)).numpy())
    assert_close_to_float64(got["output_y"], results[torch.float32][0], results[torch.float64][0])
    assert_close_to_float64(got["loss"], results[torch.float32][1], results[torch.float64][1])
    assert [o.name for o in tm.model.graph.output][-1] == "output_y"


@pytest.mark.parametrize("extra", [["y"], [0], "y", 0])
def test_extra_outputs_by_name_or_index(extra):
    _, model = small_cnn(dynamic=False)
    tm = bridge.to_training_onnx(model, loss="ce", extra_outputs=extra)
    assert tm.signature.outputs == ["y"]
    assert "output_y" in [o.name for o in tm.model.graph.output]


def test_no_extra_outputs_by_default_and_unknown_ones_rejected(cnn):
    _, model, _ = cnn
    tm = bridge.to_training_onnx(model, loss="ce")
    assert not [o.name for o in tm.model.graph.output if o.name.startswith("output_")]
    assert [o.name for o in tm.eval_model.graph.output] == ["loss", "output_y"]
    with pytest.raises(bridge.InvalidOptionError, match="extra_outputs='logits' is not a model output"):
        bridge.to_training_onnx(model, loss="ce", extra_outputs=["logits"])
    with pytest.raises(bridge.InvalidOptionError, match="extra_outputs=3 is out of range"):
        bridge.to_training_onnx(model, loss="ce", extra_outputs=3)


# -- 3. step-time checks -------------------------------------------------------------------------

def _bad_batches():
    inputs, target = batch(4, seed=5)
    nan = inputs["x"].copy()
    nan[1, 0, 2, 3] = np.nan
    return {
        "class 5 of 5": (inputs, np.array([0, 5, 1, 2]), r"class indices outside \[0, 5\) \(e.g. 5"),
        "negative class": (inputs, np.array([0, -1, 1, 2]), r"outside \[0, 5\)"),
        "float64 x": ({"x": inputs["x"].astype(np.float64)}, target, r"'x' has dtype float64.*astype\(np.float32\)"),
        "int32 target": (inputs, target.astype(np.int32), "'target' has dtype int32"),
        "wrong image size": ({"x": inputs["x"][:, :, :6]}, target, r"'x' has shape \[4, 1, 6, 8\]"),
        "batch mismatch": (inputs, target[:3], "dim 'batch' is 4 in 'x' but 3 in 'target'"),
        "NaN input": ({"x": nan}, target, "'x' holds 1 NaN/inf"),
        "missing x": ({}, target, r"lacks inputs \['x'\]"),
        "typo": ({**inputs, "X": inputs["x"]}, target, r"unknown inputs \['X'\]"),
    }


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_bad_batch_raises_before_running_and_leaves_the_state(cnn, case):
    _, _, tm = cnn
    session = tm.session()
    before = copy.deepcopy(session.state)
    inputs, target, message = _bad_batches()[case]
    with pytest.raises(bridge.StepInputError, match=message):
        session.step(inputs, target)
    assert session.state.keys() == before.keys()
    assert all(np.array_equal(session.state[k], before[k]) for k in before)
    with pytest.raises(bridge.StepInputError, match=message):
        session.evaluate(inputs, target)


def test_ignore_index_is_a_valid_target(cnn):
    _, _, tm = cnn
    inputs, _ = batch(4, seed=6)
    loss = tm.session().step(inputs, np.array([0, -100, 4, -100]))["loss"]
    assert np.isfinite(loss)


def _diverging(tm, policy: str):
    """A session whose next step overflows (lr = inf), and the state before it."""
    session = tm.session(on_nonfinite=policy)
    session.step(*batch(4, seed=7))
    session.lr = np.inf
    return session, copy.deepcopy(session.state)


def test_nonfinite_step_raises_and_leaves_the_state(cnn):
    session, before = _diverging(cnn[2], "raise")
    with pytest.raises(bridge.NonFiniteError, match=r"step 1 produced NaN/inf in \['updated_conv.weight'"):
        session.step(*batch(4, seed=8))
    assert all(np.array_equal(session.state[k], before[k]) for k in before)


def test_nonfinite_step_skipped_or_ignored_on_request(cnn):
    session, before = _diverging(cnn[2], "skip")
    session.step(*batch(4, seed=8))
    assert session.skipped_steps == 1
    assert all(np.array_equal(session.state[k], before[k]) for k in before)
    session, before = _diverging(cnn[2], "ignore")
    session.step(*batch(4, seed=8))
    assert not np.isfinite(session.state["conv.weight"]).all()
    assert int(session.state["step"]) == 2
    with pytest.raises(bridge.InvalidOptionError, match="on_nonfinite='retry'"):
        cnn[2].session(on_nonfinite="retry")


# -- 4. checkpoints ------------------------------------------------------------------------------

def _run(session, seeds) -> list[dict]:
    return [session.step(*batch(5, seed=s)) for s in seeds]


def test_resume_from_checkpoint_is_bit_identical(cnn, tmp_path):
    _, _, tm = cnn
    session = tm.session(seed=1)
    _run(session, [20, 21])
    session.lr = 0.003
    path = session.save_checkpoint(tmp_path / "ckpt.npz", extra={"epoch": 2, "schedule": [0.01, 0.003]})
    want = _run(session, [22, 23, 24])
    resumed = tm.session(seed=99)
    assert resumed.load_checkpoint(path) == {"epoch": 2, "schedule": [0.01, 0.003]}
    assert resumed.lr == np.float32(0.003) and int(resumed.state["step"]) == 2
    got = _run(resumed, [22, 23, 24])
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert all(np.array_equal(g[k], w[k]) for k in w)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]


def test_checkpoint_of_another_graph_or_damaged_is_refused(cnn, tmp_path):
    _, model, tm = cnn
    path = tm.session().save_checkpoint(tmp_path / "ckpt.npz")
    other = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.02}, extra_outputs=True)
    with pytest.raises(bridge.CheckpointError, match="written for another training graph"):
        other.session().load_checkpoint(path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(bridge.CheckpointError, match="is not a bridge checkpoint"):
        tm.session().load_checkpoint(tmp_path / "bad.npz")
    with pytest.raises(bridge.CheckpointError, match="no checkpoint at"):
        tm.session().load_checkpoint(tmp_path / "missing.npz")


def test_failed_checkpoint_write_keeps_the_previous_file(cnn, tmp_path, monkeypatch):
    _, _, tm = cnn
    session = tm.session()
    path = session.save_checkpoint(tmp_path / "ckpt.npz")
    before = path.read_bytes()
    session.step(*batch(5, seed=30))

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    with pytest.raises(OSError, match="disk full"):
        session.save_checkpoint(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]


# -- 5. back to inference ------------------------------------------------------------------------

def test_export_inference_is_the_source_model_with_trained_values(cnn, tmp_path, capfd):
    """The source's nodes, inputs and outputs, BatchNorm and Dropout in inference mode; the Constant
    that held Dropout's training_mode goes with that input, so onnxruntime warns about no unused value."""
    _, model, tm = cnn
    session = tm.session(seed=2)
    _run(session, [40, 41, 42])
    path = tm.export_inference(tmp_path / "trained.onnx", session.state)
    exported = onnx.load(str(path))
    onnx.checker.check_model(exported, full_check=True)
    assert exported.graph.input == model.graph.input and exported.graph.output == model.graph.output
    (drop,) = [n for n in model.graph.node if n.op_type == "Dropout"]
    training_mode = drop.input[2]
    assert [(n.name, n.op_type) for n in exported.graph.node] == [
        (n.name, n.op_type) for n in model.graph.node if training_mode not in n.output]
    modes = {n.op_type: n for n in exported.graph.node if n.op_type in ("BatchNormalization", "Dropout")}
    assert onnx.helper.get_attribute_value(modes["BatchNormalization"].attribute[-1]) == 0  # was 1 (training)
    assert len(modes["BatchNormalization"].output) == 1 and len(modes["Dropout"].input) == 2
    capfd.readouterr()
    ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert "onnxruntime" not in capfd.readouterr().err
    assert [i.name for i in exported.graph.initializer] == [i.name for i in model.graph.initializer]
    trained = {i.name: onnx.numpy_helper.to_array(i) for i in exported.graph.initializer}
    for name in tm.weights + tm.signature.buffers:
        np.testing.assert_array_equal(trained[name], session.state[name])
    inputs, target = batch(6, seed=43)
    (y,) = OrtGraph(exported)(inputs).values()
    np.testing.assert_allclose(y, session.evaluate(inputs, target)["output_y"], rtol=1e-5, atol=1e-6)


def test_export_inference_gives_a_shared_running_statistic_its_own_initializer():
    """Two BatchNorms whose running variances a legacy exporter de-duplicated into one tensor (read
    by one of them through an Identity): bridge trains them apart and writes them back apart."""
    from onnx import TensorProto, helper

    tensors = {name: np.full(3, value, np.float32) for name, value in
               {"ones": 1.0, "s": 1.5, "b": 0.5, "mean_a": 0.0, "mean_b": 0.1}.items()}
    graph = helper.make_graph(
        [helper.make_node("Identity", ["ones"], ["var_b"], name="share"),
         helper.make_node("BatchNormalization", ["x", "s", "b", "mean_a", "ones"], ["h"], name="bn_a"),
         helper.make_node("BatchNormalization", ["h", "s", "b", "mean_b", "var_b"], ["y"], name="bn_b")],
        "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [onnx.numpy_helper.from_array(value, name) for name, value in tensors.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    tm = bridge.to_training_onnx(model, loss="mse")
    assert "var_b" in tm.signature.buffers
    session = tm.session()
    session.step({"x": np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32) * 3},
                 np.zeros((4, 3), np.float32))
    exported = tm.inference_model(session.state)
    values = {i.name: onnx.numpy_helper.to_array(i) for i in exported.graph.initializer}
    share = next(n for n in exported.graph.node if n.name == "share")
    assert share.input[0] == "var_b.trained"
    np.testing.assert_array_equal(values["var_b.trained"], session.state["var_b"])
    assert not np.array_equal(values["var_b.trained"], np.ones(3, np.float32))
    inputs = {"x": np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)}
    (y,) = OrtGraph(exported)(inputs).values()
    np.testing.assert_allclose(y, session.evaluate(inputs, np.zeros((4, 3), np.float32))["output_y"], rtol=1e-5,
                               atol=1e-6)
