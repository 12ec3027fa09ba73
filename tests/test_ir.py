"""The annotated training IR (docs/ir.md): tags on every node, roles on every value, the
traversal API against the file, and value names checked against torch autograd."""
from __future__ import annotations

import fnmatch

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from helpers.models import gemm_mlp, matmul_add_mlp
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.errors import ModelLoadError

PHASES = {"forward", "loss", "backward", "optimizer"}
VALUE_ROLE = {"forward": "activation", "loss": "activation", "backward": "gradient", "optimizer": "update"}


def _props(entries) -> dict[str, str]:
    return {e.key: e.value for e in entries}


def _torch_mlp(tmp_path_factory):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    path = tmp_path_factory.mktemp("ir") / "mlp.onnx"
    torch.onnx.export(module, (torch.randn(5, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return module, onnx.load(str(path))


def _batchnorm_mlp(tmp_path_factory) -> onnx.ModelProto:
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    path = tmp_path_factory.mktemp("ir") / "bn.onnx"
    torch.onnx.export(module.train(), (torch.randn(4, 6),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return onnx.load(str(path))


def _small_cnn(tmp_path_factory) -> onnx.ModelProto:
    """Conv, BatchNorm, ReLU, MaxPool, Dropout, Flatten, Linear (the CNN of examples/traverse_ir.py plus Dropout)."""
    torch.manual_seed(2)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Dropout(0.25), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5),
    )
    path = tmp_path_factory.mktemp("ir") / "cnn.onnx"
    torch.onnx.export(module.train(), (torch.randn(2, 1, 8, 8),), str(path), dynamo=False, input_names=["image"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return onnx.load(str(path))


def _branching_unnamed() -> onnx.ModelProto:
    """h feeds two layers (its gradient accumulates); no node has a name."""
    rng = np.random.default_rng(3)
    weights = {"W1": rng.standard_normal((5, 7)), "W2": rng.standard_normal((7, 2))}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Sigmoid", ["h"], ["s"]),
        helper.make_node("Add", ["a", "s"], ["m"]),
        helper.make_node("MatMul", ["m", "W2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "branching",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _sum_of_squares(output, target):
    return ((output - target) ** 2).sum()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """(source model, TrainingModel) for several shapes of graph, loss and optimizer."""
    module, torch_source = _torch_mlp(tmp_path_factory)
    sources = {
        "torch_mlp_ce_adam": (torch_source, "ce", "adam"),
        "matmul_add_mse_sgd": (matmul_add_mlp()[0], "mse", "sgd"),
        "gemm_shared_ce_rmsprop": (gemm_mlp()[0], "ce", "rmsprop"),
        "branching_unnamed_callable_adam": (_branching_unnamed(), lambda o, t: F.mse_loss(o, t), "adam"),
        "branching_named_fn_sgd": (_branching_unnamed(), _sum_of_squares, "sgd"),
    }
    built = {
        key: (source, bridge.to_training_onnx(source, loss=loss, optim=optim, optim_options={"lr": 0.01}))
        for key, (source, loss, optim) in sources.items()
    }
    bn = _batchnorm_mlp(tmp_path_factory)
    built["batchnorm_clip_adamw"] = (bn, bridge.to_training_onnx(bn, loss="ce", optim="adamw", clip_grad_norm=1.0))
    built["dynamic_batch_mlp_nadam"] = (
        torch_source, bridge.to_training_onnx(torch_source, loss="mse", optim="nadam", dynamic_batch=True))
    cnn = _small_cnn(tmp_path_factory)
    built["cnn_dropout_ce_sgd_momentum"] = (
        cnn, bridge.to_training_onnx(cnn, loss="ce", optim="sgd", optim_options={"momentum": 0.9}))
    return built | {"torch_module": module}


CASES = ["torch_mlp_ce_adam", "matmul_add_mse_sgd", "gemm_shared_ce_rmsprop", "branching_unnamed_callable_adam",
         "branching_named_fn_sgd", "batchnorm_clip_adamw", "dynamic_batch_mlp_nadam", "cnn_dropout_ce_sgd_momentum"]


def _source_node_names(source: onnx.ModelProto) -> set[str]:
    """Source node names; unnamed nodes are named ``<OpType>_<index>`` (docs/ir.md)."""
    return {node.name or f"{node.op_type}_{i}" for i, node in enumerate(source.graph.node)}


@pytest.mark.parametrize("case", CASES)
def test_every_node_has_phase_layer_kind_and_prefixed_name(cases, case):
    _, tm = cases[case]
    names = [node.name for node in tm.model.graph.node]
    assert len(names) == len(set(names)), "node names are unique"
    for node in tm.model.graph.node:
        tags = _props(node.metadata_props)
        assert tags.get("bridge.phase") in PHASES, node.name
        assert tags.get("bridge.layer"), node.name
        kind = tags.get("bridge.kind")
        assert kind and kind.replace("_", "").isalnum() and kind == kind.lower(), (node.name, kind)
        assert node.name.startswith(f"{tags['bridge.phase']}_{kind}/"), node.name


@pytest.mark.parametrize("case", CASES)
def test_layers_name_source_nodes_or_weights(cases, case):
    source, tm = cases[case]
    source_nodes = _source_node_names(source)
    loss_kind = tm.model.metadata_props and _props(tm.model.metadata_props)["bridge.loss"]
    forward_layers = set()
    for node in tm.model.graph.node:
        tags = _props(node.metadata_props)
        phase, layer = tags["bridge.phase"], tags["bridge.layer"]
        if phase == "forward":
            assert layer in source_nodes, node.name
            forward_layers.add(layer)
        elif phase == "backward":
            assert layer in source_nodes or layer == "loss", node.name
        elif phase == "loss":
            assert layer == "loss", node.name
        else:  # a weight, the step counter, or global-norm gradient clipping
            assert layer in tm.weights or layer in ("step", "global"), node.name
        if layer == "loss":
            assert tags["bridge.kind"] in (loss_kind, "lambda", "sum_of_squares"), node.name
    constants = {n.name for n in source.graph.node if n.op_type == "Constant"}  # folded before the trace
    assert forward_layers == source_nodes - constants, "every source node is traced, under its own name"


def _contract_roles(tm: bridge.TrainingModel, source: onnx.ModelProto) -> dict[str, str]:
    """Roles from the I/O contract (docs/ir.md), computed from names alone."""
    data = {i.name for i in source.graph.input} - {init.name for init in source.graph.initializer}
    roles = {}
    for value in tm.model.graph.input:
        name = value.name
        if name in data:
            roles[name] = "input"
        elif name == "target":
            roles[name] = "target"
        elif name == "lr":
            roles[name] = "hyperparameter"
        elif name.endswith(".noise") and name[: -len(".noise")] in _source_node_names(source):
            roles[name] = "random"
        elif name in tm.signature.buffers:
            roles[name] = "buffer"
        elif name == "step" or any(fnmatch.fnmatch(name, f"{w}.*") and name not in tm.weights for w in tm.weights):
            roles[name] = "optimizer_state"
        elif name in tm.weights:
            roles[name] = "weight"
    for value in tm.model.graph.output:
        name = value.name
        roles[name] = "loss" if name == "loss" else "gradient" if name.startswith("grad_") else "updated"
    return roles


@pytest.mark.parametrize("case", CASES)
def test_every_graph_input_and_output_has_its_contract_role(cases, case):
    source, tm = cases[case]
    want = _contract_roles(tm, source)
    got = {v.name: _props(v.metadata_props).get("bridge.role") for v in list(tm.model.graph.input) + list(tm.model.graph.output)}
    assert got == want


@pytest.mark.parametrize("case", CASES)
def test_every_intermediate_value_has_the_role_of_its_phase(cases, case):
    _, tm = cases[case]
    graph = tm.model.graph
    boundary = {v.name for v in list(graph.input) + list(graph.output)}
    roles = {v.name: _props(v.metadata_props).get("bridge.role") for v in graph.value_info}
    for node in graph.node:
        phase = _props(node.metadata_props)["bridge.phase"]
        for out in node.output:
            if out not in boundary:
                assert roles.get(out) == VALUE_ROLE[phase], (node.name, out)


@pytest.mark.parametrize("case", CASES)
def test_api_agrees_with_the_file(cases, case, tmp_path):
    _, tm = cases[case]
    path = tm.save(tmp_path / "train.onnx")
    g = bridge.ir.load(path)
    raw = onnx.load(str(path))
    role = {v.name: _props(v.metadata_props)["bridge.role"] for v in list(raw.graph.input) + list(raw.graph.output)}
    by_role = lambda r, vs: [v.name for v in vs if role[v.name] == r]  # noqa: E731
    assert g.weights == by_role("weight", raw.graph.input) == tm.weights
    assert g.buffers == by_role("buffer", raw.graph.input)
    assert g.optimizer_state == by_role("optimizer_state", raw.graph.input)
    assert g.hyperparameters == ["lr"]
    assert g.random_inputs == by_role("random", raw.graph.input)
    assert g.inputs == tm.data_inputs and g.targets == ["target"]
    assert g.outputs == [v.name for v in raw.graph.output] and g.loss == "loss"
    assert g.gradients == {w: f"grad_{w}" for w in tm.weights}
    assert sorted(g.activations) == sorted(
        v.name for v in raw.graph.value_info if _props(v.metadata_props)["bridge.role"] == "activation"
    )
    nodes = list(g.nodes())
    assert [n.name for n in nodes] == [n.name for n in raw.graph.node]
    for node, proto in zip(nodes, raw.graph.node, strict=True):
        tags = _props(proto.metadata_props)
        assert (node.op_type, node.phase, node.layer, node.kind) == (
            proto.op_type, tags["bridge.phase"], tags["bridge.layer"], tags["bridge.kind"])
        assert node.inputs == tuple(proto.input) and node.outputs == tuple(proto.output)
        for out in node.outputs:
            assert g.producer(out) is node
            assert g.consumers(out) == [n for n in nodes if out in n.inputs]
    for phase in PHASES:
        assert [n.name for n in g.nodes(phase)] == [n.name for n in nodes if n.phase == phase]
    assert g.producer("x" if "x" in g.inputs else g.inputs[0]) is None
    with pytest.raises(ValueError, match="unknown phase"):
        list(g.nodes("backwards"))


@pytest.mark.parametrize("case", CASES)
def test_weight_to_gradient_to_update(cases, case):
    _, tm = cases[case]
    g = bridge.ir.load(tm)
    for weight in g.weights:
        readers = {n.layer for n in g.consumers(weight) if n.phase == "forward"}
        assert readers, weight
        grad = g.producer(g.gradients[weight])
        assert grad.phase == "backward" and grad.layer in readers
        assert grad in g.backward_of(grad.layer)
        users = [n for n in g.consumers(g.gradients[weight]) if n.phase == "optimizer"]
        assert users and {n.layer for n in users} <= {weight, "global"}
        update = g.producer(g.updates[weight])
        assert update.phase == "optimizer" and update.layer == weight and update in g.update_of(weight)
        for slot, state in g.state_of(weight).items():
            assert state == f"{weight}.{slot}"
            assert g.producer(g.updates[state]).layer == weight
    for layer in g.layers("forward"):
        assert all(n.phase == "backward" and n.layer == layer for n in g.backward_of(layer))


def test_running_statistics_are_buffers_updated_by_their_layer(cases):
    _, tm = cases["batchnorm_clip_adamw"]
    g = bridge.ir.load(tm)
    assert g.buffers == ["1.running_mean", "1.running_var"]
    for buffer in g.buffers:
        update = g.producer(g.updates[buffer])
        assert (update.phase, update.layer) == ("forward", "/1/BatchNormalization")
    clip = list(g.nodes("optimizer", "global"))
    assert clip and all(n.kind == "clip_grad_norm" for n in clip)


def test_cnn_layers_and_their_backward(cases):
    source, tm = cases["cnn_dropout_ce_sgd_momentum"]
    g = bridge.ir.load(tm)
    conv = next(n.name for n in source.graph.node if n.op_type == "Conv")
    dropout = next(n.name for n in source.graph.node if n.op_type == "Dropout")
    assert g.random_inputs == [f"{dropout}.noise"]
    backward = g.backward_of(conv)  # its weight gradient's form depends on the shape (docs/lowerings/conv_pool.md)
    assert g.producer("grad_0.weight").name in {n.name for n in backward}
    assert {n.phase for n in backward} == {"backward"} and any(n.op_type in ("Conv", "MatMul", "Gemm") for n in backward)
    assert g.producer("grad_0.weight").layer == conv
    assert g.state_of("0.weight") == {"momentum_buffer": "0.weight.momentum_buffer"}
    assert g.role("grad_logits") == "gradient" and g.producer("grad_logits").layer == "loss"


def test_gradient_accumulation_and_step_are_tagged(cases):
    source, tm = cases["branching_unnamed_callable_adam"]
    g = bridge.ir.load(tm)
    assert "MatMul_0" in g.layers("forward") and "Relu_1" in g.layers("forward")
    step = g.producer("updated_step")
    assert (step.phase, step.layer, step.kind) == ("optimizer", "step", "adam")
    assert step.name.startswith("optimizer_adam/step/")


def _run_with_outputs(tm: bridge.TrainingModel, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
    model = onnx.ModelProto()
    model.CopyFrom(tm.model)
    infos = {v.name: v for v in model.graph.value_info}
    model.graph.output.extend(infos[n] for n in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds), strict=True))


def test_boundary_value_names_hold_what_they_say(cases):
    """``/0/Gemm_output_0`` is that layer's output, ``grad_<v>`` is dloss/dv: checked with torch."""
    module = cases["torch_module"]
    _, tm = cases["torch_mlp_ce_adam"]
    g = bridge.ir.load(tm)
    activations = ["/0/Gemm_output_0", "/1/Tanh_output_0", "y"]
    names = activations + [f"grad_{v}" for v in activations]
    assert all(g.role(v) == "activation" for v in activations)
    assert all(g.role(f"grad_{v}") == "gradient" for v in activations)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    target = rng.integers(0, 4, 5)
    got = _run_with_outputs(tm, names, {**tm.initial_state(), "x": x, "target": target})

    values = [torch.tensor(x)]
    for layer in module:
        values.append(layer(values[-1]))
        values[-1].retain_grad()
    F.cross_entropy(values[-1], torch.tensor(target)).backward()
    for name, value in zip(activations, values[1:], strict=True):
        np.testing.assert_allclose(got[name], value.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[f"grad_{name}"], value.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_load_rejects_what_is_not_a_training_graph(tmp_path):
    with pytest.raises(ModelLoadError, match="no bridge.role"):
        bridge.ir.load(matmul_add_mlp()[0])
    with pytest.raises(ModelLoadError, match="does not exist"):
        bridge.ir.load(tmp_path / "missing.onnx")


@pytest.mark.parametrize("case", CASES)
def test_graph_is_clean_for_onnx_mlir(cases, case):
    _, tm = cases[case]
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
