"""Option handling: bad names, options and values raise InvalidOptionError naming the culprit
and listing the valid choices; clip_grad_norm= and the CLI flag; trainable=/frozen= patterns."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import bridge
from bridge.cli import main
from bridge.pipeline.losses import available_losses, make_loss
from bridge.pipeline.optimizers import available_optimizers, make_optimizer

EXAMPLE = "examples/models/mlp.onnx"  # features [batch, 8] -> logits [batch, 3]; fc1/fc2 weights and biases


def test_invalid_option_error_is_a_bridge_error():
    assert issubclass(bridge.InvalidOptionError, bridge.BridgeError)


def test_unknown_loss_lists_every_loss():
    with pytest.raises(bridge.InvalidOptionError, match="'hinge'") as info:
        make_loss("hinge")
    assert all(name in str(info.value) for name in available_losses())


def test_unknown_optimizer_lists_every_optimizer():
    with pytest.raises(bridge.InvalidOptionError, match="'adamm'") as info:
        make_optimizer("adamm")
    assert all(name in str(info.value) for name in available_optimizers())


def test_optimizer_class_without_rule_lists_supported_classes():
    with pytest.raises(bridge.InvalidOptionError, match="LBFGS") as info:
        make_optimizer(torch.optim.LBFGS)
    assert "NAdam" in str(info.value) and "RAdam" in str(info.value)


@pytest.mark.parametrize("optim, options, unknown, valid", [
    ("sgd", {"momentun": 0.9}, "momentun", "nesterov"),
    ("adam", {"beta": (0.9, 0.99)}, "beta", "betas"),
    ("radam", {"decoupled": True}, "decoupled", "decoupled_weight_decay"),
    ("nadam", {"momentum": 0.9}, "momentum", "momentum_decay"),
])
def test_unknown_optimizer_option_lists_valid_options(optim, options, unknown, valid):
    with pytest.raises(bridge.InvalidOptionError, match=unknown) as info:
        make_optimizer(optim, options)
    assert valid in str(info.value)


@pytest.mark.parametrize("optim, options, culprit", [
    ("sgd", {"lr": -0.1}, "learning rate"),
    ("adam", {"betas": (1.0, 0.999)}, "beta"),
    ("adamw", {"betas": (0.9, -0.1)}, "beta"),
    ("adam", {"eps": -1e-8}, "epsilon"),
    ("rmsprop", {"alpha": -0.5}, "alpha"),
    ("adagrad", {"lr_decay": -1.0}, "lr_decay"),
    ("adadelta", {"rho": 1.5}, "rho"),
    ("sgd", {"nesterov": True}, "Nesterov"),
    ("nadam", {"momentum_decay": -1.0}, "momentum_decay"),
])
def test_invalid_optimizer_values_name_the_option(optim, options, culprit):
    with pytest.raises(bridge.InvalidOptionError, match=culprit) as info:
        make_optimizer(optim, options)
    assert optim in str(info.value)


@pytest.mark.parametrize("loss, options, culprit, valid", [
    ("ce", {"smoothing": 0.1}, "smoothing", "label_smoothing"),
    ("mse", {"beta": 1.0}, "beta", "reduction"),
    ("huber", {"beta": 1.0}, "beta", "delta"),
    ("ce", {"reduction": "none"}, "none", "sum"),
    ("kl_div", {"reduction": "elementwise"}, "elementwise", "batchmean"),
    ("ce", {"label_format": "onehot"}, "onehot", "probabilities"),
    ("mse", {"label_format": "indices"}, "indices", "probabilities"),
])
def test_bad_loss_options_name_the_option(loss, options, culprit, valid):
    with pytest.raises(bridge.InvalidOptionError, match=culprit) as info:
        make_loss(loss, options)
    assert valid in str(info.value)


@pytest.mark.parametrize("loss, options, culprit", [
    ("ce", {"label_smoothing": 1.5}, "label_smoothing"),
    ("ce", {"weight": [1.0, 2.0]}, "weight"),
    ("smooth_l1", {"beta": -1.0}, "beta"),
    ("huber", {"delta": -1.0}, "delta"),
])
def test_invalid_loss_values_fail_at_conversion(loss, options, culprit):
    with pytest.raises(bridge.InvalidOptionError, match=culprit):
        bridge.to_training_onnx(EXAMPLE, loss=loss, loss_options=options)


def test_callable_and_module_losses_reject_torch_options():
    with pytest.raises(bridge.InvalidOptionError, match="reduction"):
        make_loss(lambda out, tgt: (out - tgt).abs().mean(), {"reduction": "sum"})
    with pytest.raises(bridge.InvalidOptionError, match="label_smoothing"):
        make_loss(torch.nn.CrossEntropyLoss(), {"label_smoothing": 0.1})


def test_loss_module_settings_are_kept():
    loss = make_loss(torch.nn.HuberLoss(delta=0.25, reduction="sum"))
    assert (loss.name, loss.options) == ("huber", {"reduction": "sum", "delta": 0.25})
    assert make_loss(torch.nn.CrossEntropyLoss()).label_format == "indices"


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), "1.0", True])
def test_invalid_clip_grad_norm(value):
    with pytest.raises(bridge.InvalidOptionError, match="clip_grad_norm"):
        bridge.to_training_onnx(EXAMPLE, clip_grad_norm=value)


@pytest.mark.parametrize("argument", ["trainable", "frozen"])
def test_pattern_matching_no_weight_is_named(argument):
    with pytest.raises(bridge.InvalidOptionError, match=r"conv\*") as info:
        bridge.to_training_onnx(EXAMPLE, **{argument: ["fc1.*", "conv*"]})
    assert argument in str(info.value) and "fc2.weight" in str(info.value)


def test_trainable_and_frozen_select_weights():
    tm = bridge.to_training_onnx(EXAMPLE, trainable="fc*", frozen=["*.bias"])
    assert tm.weights == ["fc1.weight", "fc2.weight"]
    inputs = {i.name for i in tm.model.graph.input}
    grads = {o.name for o in tm.model.graph.output if o.name.startswith("grad_")}
    assert not inputs & {"fc1.bias", "fc2.bias"}
    assert grads == {"grad_fc1.weight", "grad_fc2.weight"}


def test_cli_clip_grad_norm(tmp_path):
    out = tmp_path / "train.onnx"
    assert main(["convert", EXAMPLE, "-o", str(out), "--optim", "adam", "--clip-grad-norm", "0.5"]) == 0
    kinds = {
        p.value for node in onnx.load(str(out)).graph.node for p in node.metadata_props if p.key == "bridge.kind"
    }
    assert "clip_grad_norm" in kinds


def test_cli_rejects_bad_clip_grad_norm(tmp_path, capsys):
    assert main(["convert", EXAMPLE, "-o", str(tmp_path / "t.onnx"), "--clip-grad-norm", "-2"]) == 2
    assert "clip_grad_norm" in capsys.readouterr().err


@pytest.mark.slow
def test_docs_op_tables_are_current():
    """docs/losses_and_optimizers.md's tables are what docs/op_tables.py derives from conversions."""
    from generated_docs import assert_generated_block_current

    assert_generated_block_current("op_tables.py", "losses_and_optimizers.md", "tables")


@pytest.mark.parametrize("op_type, attrs", [("Sum", {}), ("Max", {}), ("Identity", {})])
def test_a_weight_that_is_the_output_itself_is_trained(op_type, attrs):
    """A graph whose output is a weight as it is (Sum or Max of one input, Identity: the importer
    hands back the weight tensor itself) trains it, as torch would: y = w, mse to 0."""
    w = np.array([[1.0, -2.0, 3.0]], np.float32)
    graph = helper.make_graph([helper.make_node(op_type, ["w"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
                              [onnx.numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.5})
    assert tm.weights == ["w"]
    out = tm.session().step({"x": np.zeros((1, 3), np.float32)}, np.zeros((1, 3), np.float32))
    np.testing.assert_allclose(out["grad_w"], 2 * w / w.size, rtol=1e-6)  # d mean((w - 0)^2) / dw
    np.testing.assert_allclose(out["updated_w"], w - 0.5 * 2 * w / w.size, rtol=1e-6)
