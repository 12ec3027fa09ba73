"""The tracer's speed-ups keep the graph: the optimizer update traced once per kind of weight and replayed."""
from __future__ import annotations

import pytest
import torch

import bridge
import bridge.optimizers
import bridge.trace


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> str:
    """Six weights of three kinds (shape and dtype): [8, 6]; [8, 8] twice; [8] three times."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 8))
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    torch.onnx.export(module, (torch.randn(4, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return str(path)


def _convert(path: str, optim: str, monkeypatch, replay: bool) -> tuple[bridge.TrainingModel, int]:
    """The conversion and how many times the optimizer's rule was traced; ``replay=False``: every weight traced."""
    calls = []
    update = bridge.optimizers.Optimizer.update
    with monkeypatch.context() as patch:
        patch.setattr(bridge.optimizers.Optimizer, "update", lambda self, *args: calls.append(1) or update(self, *args))
        if not replay:
            patch.setattr(bridge.trace._UpdateReplay, "update", lambda self, *args: self.optimizer.update(*args))
        tm = bridge.to_training_onnx(path, loss="mse", optim=optim, clip_grad_norm=1.0)
    return tm, len(calls)


@pytest.mark.parametrize("optim", ["adam", "nadam"])  # nadam: a 0-d state slot beside the weight-shaped ones
def test_update_traced_once_per_kind_of_weight_same_graph(mlp_path, monkeypatch, optim):
    replayed, traced = _convert(mlp_path, optim, monkeypatch, replay=True)
    assert traced == 3, "the update is traced once per kind of weight, not once per weight"
    every, traced = _convert(mlp_path, optim, monkeypatch, replay=False)
    assert traced == 6
    for part in ("model", "update_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"
