"""Normalization ops in training: loss, grads, updated weights and running statistics vs torch.

The twins are torch.nn.functional's batch_norm / layer_norm / instance_norm / group_norm /
normalize; float64 end to end (rtol 1e-9) so an off-by-one in a count or a biased/unbiased
mix-up cannot hide in float32 noise.
"""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import assert_importer_matches_onnxruntime
from helpers.single_op import batches_for, one_node_model, train_and_compare
from helpers.training import assert_trains_like
from onnx import numpy_helper

import bridge
from bridge.cli import main

RTOL = 1e-9
EPS = 2.0 ** -10  # exact in the float32 epsilon attribute
rng = np.random.default_rng(7)


def _params(*shapes) -> list[np.ndarray]:
    return [rng.standard_normal(s) for s in shapes]


def _forbidden_ops(tm: bridge.TrainingModel) -> set[str]:
    """Ops in the training graph that must not be there (inference-only or native forms); a
    BatchNormalization is there only as bridge's ``affine`` (mean 0, variance 1, epsilon 0)."""
    constants = {t.name: numpy_helper.to_array(t) for t in tm.model.graph.initializer}
    found = {n.op_type for n in tm.model.graph.node if not _is_affine(n, constants)}
    return found & {"BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization"}


def _is_affine(node: onnx.NodeProto, constants: dict) -> bool:
    if node.op_type != "BatchNormalization" or len(node.input) != 5 or len(node.output) != 1:
        return False
    mean, variance = constants.get(node.input[3]), constants.get(node.input[4])
    epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    return mean is not None and variance is not None and not mean.any() and (variance == 1).all() and epsilon == 0


@pytest.mark.parametrize("opset", [9, 14, 15])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 4, 3), (2, 2, 3, 2, 2)], ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("momentum", [0.9, 0.7])
def test_batch_norm_training_matches_torch(opset, shape, momentum):
    channels = shape[1]
    scale, bias, mean = _params(channels, channels, channels)
    var = rng.random(channels) + 0.5
    model = one_node_model("BatchNormalization", ["x", "s", "b", "rm", "rv"], {"x": np.zeros(shape)},
                           {"s": scale, "b": bias, "rm": mean, "rv": var}, opset, epsilon=EPS, momentum=momentum)
    running = {"rm": torch.tensor(mean), "rv": torch.tensor(var)}
    history = []
    momentum32, eps32 = float(np.float32(momentum)), EPS  # ONNX float attributes

    def twin(p, inputs):
        out = F.batch_norm(inputs["x"], running["rm"], running["rv"], p["s"], p["b"], training=True,
                           momentum=1 - momentum32, eps=eps32)
        history.append({k: v.clone().numpy() for k, v in running.items()})
        return out

    batches = batches_for({"x": shape}, shape, 2)
    tm, got = train_and_compare(model, {"s": scale, "b": bias}, twin, batches, steps_rtol=RTOL)
    assert tm.signature.buffers == ["rm", "rv"]
    assert {"updated_rm", "updated_rv"} <= {o.name for o in tm.model.graph.output}
    for step, (g, w) in enumerate(zip(got, history, strict=True)):
        np.testing.assert_allclose(g["updated_rm"], w["rm"], rtol=RTOL, err_msg=f"step {step}")
        np.testing.assert_allclose(g["updated_rv"], w["rv"], rtol=RTOL, err_msg=f"step {step}")
    assert not _forbidden_ops(tm)


def test_batch_norm_running_stats_match_torch_module_after_a_step():
    """float32, exported from a fresh torch.nn.BatchNorm2d: the legacy exporter de-duplicates
    running_mean (zeros) with bias (zeros) through an Identity; the buffer must stay its own."""
    module = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.2), torch.nn.Flatten())
    torch.nn.init.normal_(module[0].weight)
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.randn(4, 3, 2, 2),), buffer, dynamo=False, input_names=["x"], output_names=["y"])
    source = onnx.load_from_string(buffer.getvalue())
    assert "Identity" in {n.op_type for n in source.graph.node}
    tm = bridge.to_training_onnx(source, loss="mse", optim="sgd")
    assert tm.signature.buffers == ["0.running_mean", "0.running_var"]
    assert sorted(tm.weights) == ["0.bias", "0.weight"]
    x = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    target = rng.standard_normal((4, 12)).astype(np.float32)
    out = tm.session().step({"x": x}, target)
    module.train()
    loss = F.mse_loss(module(torch.tensor(x)), torch.tensor(target))
    loss.backward()
    for name in tm.signature.buffers:
        np.testing.assert_allclose(out[f"updated_{name}"], module.state_dict()[name].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for name, param in module.named_parameters():
        np.testing.assert_allclose(out[f"grad_{name}"], param.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_batch_norm_one_value_per_channel_is_an_error():
    channels = 3
    model = one_node_model("BatchNormalization", ["x", "s", "b", "rm", "rv"], {"x": np.zeros((1, channels), np.float32)},
                           {k: np.ones(channels, np.float32) for k in ("s", "b", "rm", "rv")}, 15, name="bn1")
    with pytest.raises(bridge.BridgeError, match="bn1.*more than 1 value per channel"):
        bridge.to_training_onnx(model, loss="mse", optim="sgd")
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(torch.zeros(1, channels), None, None, training=True)


@pytest.mark.parametrize("shape, axis", [((3, 5), -1), ((2, 3, 4), -1), ((2, 3, 4), 1), ((2, 3, 2, 3), -2), ((2, 3, 4), 0)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_torch(shape, axis, with_bias):
    normalized = shape[axis % len(shape):]
    scale, bias = _params(normalized, normalized)
    inits = {"s": scale, "b": bias} if with_bias else {"s": scale}
    model = one_node_model("LayerNormalization", ["x", "s"] + (["b"] if with_bias else []), {"x": np.zeros(shape)},
                           inits, 17, axis=axis, epsilon=EPS)
    feed = {"x": rng.standard_normal(shape)}
    assert_importer_matches_onnxruntime(model, feed, rtol=1e-9, atol=1e-12, training=True)

    def twin(p, inputs):
        return F.layer_norm(inputs["x"], normalized, p["s"], p.get("b"), eps=EPS)

    train_and_compare(model, inits, twin, batches_for({"x": shape}, shape, 2), steps_rtol=RTOL)


@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 3), (1, 2, 2, 2, 3)], ids=lambda s: f"{len(s)}d")
def test_instance_norm_matches_torch(shape):
    scale, bias = _params(shape[1], shape[1])
    model = one_node_model("InstanceNormalization", ["x", "s", "b"], {"x": np.zeros(shape)}, {"s": scale, "b": bias}, 15,
                           epsilon=EPS)

    def twin(p, inputs):
        return F.instance_norm(inputs["x"], weight=p["s"], bias=p["b"], eps=EPS)

    tm, _ = train_and_compare(model, {"s": scale, "b": bias}, twin, batches_for({"x": shape}, shape, 2), steps_rtol=RTOL)
    assert not _forbidden_ops(tm)


@pytest.mark.parametrize("shape, groups", [((2, 6, 4), 3), ((2, 4, 3, 3), 2), ((3, 4, 5), 4), ((2, 4, 2, 2), 1)])
def test_group_norm_matches_torch(shape, groups):
    scale, bias = _params(shape[1], shape[1])
    model = one_node_model("GroupNormalization", ["x", "s", "b"], {"x": np.zeros(shape)}, {"s": scale, "b": bias}, 21,
                           out_shape=shape, num_groups=groups, epsilon=EPS)

    def twin(p, inputs):
        return F.group_norm(inputs["x"], groups, p["s"], p["b"], eps=EPS)

    train_and_compare(model, {"s": scale, "b": bias}, twin, batches_for({"x": shape}, shape, 2), steps_rtol=RTOL)


def test_group_norm_channels_not_divisible_is_an_error():
    model = one_node_model("GroupNormalization", ["x", "s", "b"], {"x": np.zeros((2, 6, 3))},
                           {"s": np.ones(6), "b": np.zeros(6)}, 21, out_shape=(2, 6, 3), name="gn", num_groups=4)
    with pytest.raises(bridge.BridgeError, match="'gn'.*6 channels .*num_groups=4"):
        bridge.to_training_onnx(model)


@pytest.mark.parametrize("p, axis", [(2, -1), (1, 1), (2, 0)])
def test_lp_normalization_matches_torch(p, axis):
    shape = (3, 4)
    pre = rng.standard_normal(shape)
    model = one_node_model("LpNormalization", ["x"], {"x": np.zeros(shape)}, {}, 13, prescale=pre, p=p, axis=axis)

    def twin(params, inputs):
        return F.normalize(inputs["x"] * params["w_pre"], p=p, dim=axis, eps=0.0)

    train_and_compare(model, {"w_pre": pre}, twin, batches_for({"x": shape}, shape, 2), steps_rtol=RTOL)


def test_mean_variance_normalization_matches_onnxruntime_and_torch():
    """float32: onnxruntime's MeanVarianceNormalization function mixes a float epsilon into doubles."""
    shape = (2, 3, 4, 2)
    pre = rng.standard_normal(shape).astype(np.float32)
    model = one_node_model("MeanVarianceNormalization", ["x"], {"x": np.zeros(shape, np.float32)}, {}, 13,
                           out_shape=shape, prescale=pre)
    feed = {"x": rng.standard_normal(shape).astype(np.float32)}
    assert_importer_matches_onnxruntime(model, feed, rtol=1e-5, atol=1e-6, training=True)

    def twin(params, inputs):
        x = inputs["x"] * params["w_pre"]
        mean = x.mean((0, 2, 3), keepdim=True)
        return (x - mean) / (x.var((0, 2, 3), keepdim=True, unbiased=False).sqrt() + 1e-9)

    batches = batches_for({"x": shape}, shape, 2, dtype=np.float32)
    train_and_compare(model, {"w_pre": pre}, twin, batches, steps_rtol=1e-5)


def test_batch_norm_with_a_symbolic_batch_matches_torch_at_two_batch_sizes():
    """One training graph (batch dim 'N') used at batch 2 then 5: the unbiased-variance count follows."""
    channels = 3
    scale, bias, mean = _params(channels, channels, channels)
    var = rng.random(channels) + 0.5
    model = one_node_model("BatchNormalization", ["x", "s", "b", "rm", "rv"], {"x": np.zeros((2, channels, 2))},
                           {"s": scale, "b": bias, "rm": mean, "rv": var}, 15, out_shape=["N", channels, 2], epsilon=EPS)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "N"
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    running = {"rm": torch.tensor(mean), "rv": torch.tensor(var)}
    session = tm.session()
    for batch in (2, 5):
        x, target = rng.standard_normal((batch, channels, 2)), rng.standard_normal((batch, channels, 2))
        out = session.step({"x": x}, target)
        # the default momentum attribute is the float32 0.9, as every ONNX float attribute
        F.batch_norm(torch.tensor(x), running["rm"], running["rv"], training=True,
                     momentum=1 - float(np.float32(0.9)), eps=EPS)
        np.testing.assert_allclose(out["updated_rm"], running["rm"].numpy(), rtol=RTOL)
        np.testing.assert_allclose(out["updated_rv"], running["rv"].numpy(), rtol=RTOL)


def test_batch_norm_saved_statistics_stay_differentiable_before_opset_14():
    """Opsets < 14 output the batch's mean and variance (saved_mean, saved_var); a graph that uses
    them downstream gets their gradient (they are not the fused kernel's non-differentiable ones)."""
    shape, channels = (4, 3), 3
    scale, bias, mean = _params(channels, channels, channels)
    var = rng.random(channels) + 0.5
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("BatchNormalization", ["x", "s", "b", "rm", "rv"], ["bn", "rm_out", "rv_out", "saved_mean",
                                                                                   "saved_var"], epsilon=EPS),
         onnx.helper.make_node("Add", ["bn", "saved_mean"], ["with_mean"]),
         onnx.helper.make_node("Mul", ["with_mean", "saved_var"], ["y"])],
        "bn_saved_statistics", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, shape)],
        [onnx.numpy_helper.from_array(v, k) for k, v in {"s": scale, "b": bias, "rm": mean, "rv": var}.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 9)])

    def twin(p, inputs):
        x = inputs["x"] * p["s"]  # scale also scales the input: the saved statistics depend on a weight
        y = F.batch_norm(x, None, None, p["s"], p["b"], training=True, eps=EPS)
        return (y + x.mean(0)) * x.var(0, unbiased=False)

    scaled = onnx.helper.make_node("Mul", ["x_in", "s"], ["x"])
    model.graph.node.insert(0, scaled)
    model.graph.input[0].name = "x_in"
    batches = [({"x_in": b["x"]}, t) for b, t in batches_for({"x": shape}, shape, 2)]
    train_and_compare(model, {"s": scale, "b": bias}, lambda p, i: twin(p, {"x": i["x_in"]}), batches, steps_rtol=RTOL)


@pytest.mark.parametrize("opset, outputs", [(9, 1), (14, 1), (15, 3)], ids=["opset9", "opset14", "opset15-training-node"])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 5), (2, 3, 4, 3), (2, 2, 3, 2, 2)], ids=lambda s: f"{len(s)}d")
def test_frozen_batch_norm_trains_as_torchs_batch_norm_in_eval(opset, outputs, shape):
    """``batch_norm="frozen"``: the running statistics normalize and stay fixed (no buffers), as a torch BatchNorm in
    ``eval()`` inside a model that trains; scale, bias and the weight before it (a prescale) train. Also on a node
    that asks for batch statistics (``training_mode=1``, a train-mode export)."""
    channels = shape[1]
    scale, bias, pre = _params(channels, channels, shape[1:])
    mean, var = rng.standard_normal(channels) + 2, rng.random(channels) + 0.5  # far from (0, 1): they must be read
    mode = {"training_mode": 1} if outputs > 1 else {}
    model = one_node_model("BatchNormalization", ["x", "s", "b", "rm", "rv"], {"x": np.zeros(shape)},
                           {"s": scale, "b": bias, "rm": mean, "rv": var}, opset, outputs=outputs, prescale=pre,
                           epsilon=EPS, **mode)

    def twin(p, inputs):
        return F.batch_norm(inputs["x"] * p["w_pre"], torch.tensor(mean), torch.tensor(var), p["s"], p["b"],
                            training=False, eps=EPS)

    batches = batches_for({"x": shape}, shape, 3)
    tm, got = train_and_compare(model, {"s": scale, "b": bias, "w_pre": pre}, twin, batches, steps_rtol=RTOL,
                                batch_norm="frozen")
    assert tm.signature.buffers == []
    assert not {o.name for o in tm.model.graph.output} & {"updated_rm", "updated_rv"}
    assert not _forbidden_ops(tm)


def _bn_cnn() -> torch.nn.Module:
    """Conv -> BatchNorm -> ReLU twice, running statistics away from (0, 1) and affine weights not (1, 0)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Conv2d(4, 5, 3), torch.nn.BatchNorm2d(5), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(5 * 4 * 4, 3))
    for bn in (module[1], module[4]):
        bn.running_mean.normal_(0, 1)
        bn.running_var.uniform_(0.5, 2)
        torch.nn.init.normal_(bn.weight)
        torch.nn.init.normal_(bn.bias)
    return module


def _exported(module: torch.nn.Module, training: torch.onnx.TrainingMode) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.randn(4, 3, 6, 6),), buffer, dynamo=False, training=training,
                      do_constant_folding=False, input_names=["x"], output_names=["y"])
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("memory", ["default", "min"])
@pytest.mark.parametrize("export_mode", [torch.onnx.TrainingMode.EVAL, torch.onnx.TrainingMode.TRAINING],
                         ids=["eval-export", "train-export"])
def test_frozen_batch_norm_cnn_trains_as_torch_with_its_batch_norms_in_eval(export_mode, memory):
    """float32, Adam, 3 steps: a CNN converted with ``batch_norm="frozen"`` trains as the torch module in ``train()``
    with its BatchNorms in ``eval()`` (the gradient through BatchNorm to the Conv before it included), whichever mode
    the file was exported in; the running statistics are constants of the graph, not state."""
    module = _bn_cnn()
    source = _exported(module.train(export_mode == torch.onnx.TrainingMode.TRAINING), export_mode)
    tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": 1e-2}, batch_norm="frozen",
                                 memory=memory)
    assert tm.signature.buffers == []
    assert not any("running" in name for name in tm.initial_state())
    module.train()
    module[1].eval()
    module[4].eval()
    batches = [({"x": rng.standard_normal((4, 3, 6, 6)).astype(np.float32)}, rng.integers(0, 3, 4))
               for _ in range(3)]
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.Adam, {"lr": 1e-2})


def test_batch_norm_mode_is_train_or_frozen(tmp_path):
    source = _exported(_bn_cnn().eval(), torch.onnx.TrainingMode.EVAL)
    with pytest.raises(bridge.BridgeError, match=r"batch_norm='eval'.*\['train', 'frozen'\]"):
        bridge.to_training_onnx(source, loss="ce", batch_norm="eval")
    path, out = tmp_path / "cnn.onnx", tmp_path / "train.onnx"
    onnx.save(source, path)
    assert main(["convert", str(path), "--loss", "ce", "--batch-norm", "frozen", "-o", str(out)]) == 0
    assert not [o.name for o in onnx.load(out).graph.output if "running" in o.name]
    assert main(["convert", str(path), "--loss", "ce", "-o", str(out)]) == 0
    assert [o.name for o in onnx.load(out).graph.output if "running" in o.name]
