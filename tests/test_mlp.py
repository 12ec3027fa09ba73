"""End to end on MLPs: loss, every gradient and every updated weight over 3 steps, vs torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import gemm_mlp, matmul_add_mlp
from helpers.reference import assert_steps_match, bridge_steps, random_batches, torch_steps
from helpers.training import assert_trains_like, module_weights

import bridge

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop}
LOSSES = {"mse": F.mse_loss, "ce": F.cross_entropy}


def _export(module: torch.nn.Module, example: torch.Tensor, path) -> str:
    torch.onnx.export(module, (example,), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return str(path)


@pytest.fixture(scope="module")
def torch_mlp(tmp_path_factory):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    path = _export(module, torch.randn(5, 6), tmp_path_factory.mktemp("mlp") / "mlp.onnx")
    return module, path


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("loss", LOSSES)
def test_torch_exported_mlp_matches_torch(torch_mlp, loss, optim):
    module, path = torch_mlp
    tm = bridge.to_training_onnx(path, loss=loss, optim=optim, optim_options={"lr": 0.05})
    batches = random_batches(tm, 3, classes=4)
    assert set(tm.weights) == set(module_weights(module))
    assert_trains_like(tm, module, batches, LOSSES[loss], OPTIMIZERS[optim], {"lr": 0.05})


def _matmul_twin(params, inputs):
    return torch.relu(inputs["x"] @ params["W1"] + params["b1"]) @ params["W2"]


def _gemm_twin(params, inputs):
    hidden = torch.sigmoid(0.5 * (inputs["xt"].T @ params["W"].T) + 2.0 * params["C"])
    return 1.5 * (hidden @ params["W"])


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("build, twin", [(matmul_add_mlp, _matmul_twin), (gemm_mlp, _gemm_twin)], ids=["matmul_add", "gemm"])
def test_handwritten_mlp_matches_torch_twin(build, twin, loss, optim):
    model, weights = build()
    tm = bridge.to_training_onnx(model, loss=loss, optim=optim, optim_options={"lr": 0.02})
    assert sorted(tm.weights) == sorted(weights), "every float initializer, shared ones once"
    batches = random_batches(tm, 3, classes=3)
    want = torch_steps(twin, weights, LOSSES[loss], OPTIMIZERS[optim], {"lr": 0.02}, batches)
    assert_steps_match(bridge_steps(tm, batches), want)


def test_linear_layers_train_without_a_transpose(torch_mlp):
    """A product with a transposed matrix is one Gemm reading that matrix as it is (``transA`` /
    ``transB``): the forward reads each Linear weight untransposed, each weight gradient comes out in
    the weight's layout, and the whole step runs no Transpose."""
    _, path = torch_mlp
    graph = bridge.to_training_onnx(path, loss="ce", optim="sgd").model.graph
    assert not [node.name for node in graph.node if node.op_type == "Transpose"]
    gemms = {(node.input[0], node.input[1]): {a.name: a.i for a in node.attribute} for node in graph.node
             if node.op_type == "Gemm"}
    weights = [name for name in (i.name for i in graph.input) if name.endswith("weight")]
    assert len(weights) == 2
    for weight in weights:
        assert [attrs for (a, b), attrs in gemms.items() if b == weight] == [{"transB": 1}]
    assert sum(attrs == {"transA": 1} for attrs in gemms.values()) == 2  # grad_W = grad_y^T x
