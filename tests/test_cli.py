"""The command line: convert writes the training model and its initial state."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx

from bridge.cli import main


def test_convert_writes_model_and_state(tmp_path):
    out = tmp_path / "train.onnx"
    assert main(["convert", "examples/models/mlp.onnx", "--loss", "ce", "--optim", "rmsprop", "-o", str(out)]) == 0
    model = onnx.load(out)
    state = np.load(tmp_path / "train.state.npz")
    state_inputs = [i.name for i in model.graph.input if i.name not in ("features", "target")]
    assert sorted(state.files) == sorted(state_inputs)
    assert "fc1.weight.square_avg" in state.files


def test_console_script_help():
    result = subprocess.run([sys.executable, "-m", "bridge.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "convert" in result.stdout
