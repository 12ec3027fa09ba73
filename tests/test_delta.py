"""Federated-ready state (bridge/training/delta.py): a Trainer writes only its trained weights' change since
the round started, and loads an average of such deltas; examples/fedavg.py runs FedAvg over files."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from lifecycle_models import mlp_and_data

import bridge
from bridge.training.delta import DeltaError, average_deltas, read_delta, write_delta


def _lora_trainer(seed: int = 0) -> tuple[bridge.Trainer, dict, np.ndarray]:
    _, model, x, y = mlp_and_data()
    tm = bridge.to_training_onnx(model, "mse", "adam", lora={"rank": 2, "targets": ["*.weight"]})
    return bridge.Trainer(tm, seed=seed), {"x": x.numpy()}, y.numpy()


def test_a_lora_delta_holds_the_adapters_change_and_loads_back(tmp_path):
    trainer, inputs, target = _lora_trainer()
    start = trainer.state()
    for _ in range(2):
        trainer.step(inputs, target)
    trained = trainer.state()
    delta, samples = read_delta(trainer.export_delta(tmp_path / "delta.npz", samples=5))
    adapters = trainer.training_model.lora.adapter_names
    assert sorted(delta) == sorted(adapters) and samples == 5
    for name in adapters:
        np.testing.assert_array_equal(delta[name], trained[name].astype(np.float64) - start[name])

    other, _, _ = _lora_trainer(seed=1)  # a second client, still at the round's start
    other.load_delta(tmp_path / "delta.npz")
    for name in adapters:
        np.testing.assert_array_equal(other.state()[name], trained[name])
    assert other.state()["step"] == 0  # optimizer state stays the client's own
    np.testing.assert_array_equal(read_delta(other.export_delta(tmp_path / "none.npz"))[0][adapters[0]], 0)


def test_average_deltas_weights_by_samples(tmp_path):
    one = write_delta(tmp_path / "one.npz", {"w": np.array([1.0, 2.0])}, samples=1)
    three = write_delta(tmp_path / "three.npz", {"w": np.array([5.0, -2.0])}, samples=3)
    mean, total = average_deltas([one, three])
    np.testing.assert_array_equal(mean["w"], [(1 + 15) / 4, (2 - 6) / 4])
    assert total == 4


def test_a_delta_of_other_weights_is_refused(tmp_path):
    trainer, _, _ = _lora_trainer()
    write_delta(tmp_path / "other.npz", {"0.weight": np.zeros((8, 6))})
    with pytest.raises(DeltaError, match=r"0\.weight"):
        trainer.load_delta(tmp_path / "other.npz")
    with pytest.raises(DeltaError, match="no delta"):
        trainer.load_delta(tmp_path / "missing.npz")


@pytest.mark.slow
def test_fedavg_example_agrees_and_learns():
    result = subprocess.run([sys.executable, "examples/fedavg.py"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"global test accuracy (\d\.\d+)", result.stdout)]
    assert len(accuracies) == 6 and accuracies[-1] >= 0.9 > accuracies[0], result.stdout
    assert "weighted mean of their local weights: True" in result.stdout
