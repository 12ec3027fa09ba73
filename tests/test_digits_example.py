"""examples/digits.py (run by ``make demo``): the lifecycle on real data (scikit-learn's digits)
learns to >= 95% test accuracy, within 1 point of the same training in torch, and the exported
inference model classifies the test split exactly as the eval graph did."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed")
def test_digits_example_learns_like_torch_and_exports(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's bridge, not an installed one
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "digits.py"), str(tmp_path)], capture_output=True,
                            text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr == ""  # make demo's second half: no onnxruntime or Python warning about bridge's graphs
    bridge_losses = [float(x) for x in re.findall(r"bridge: loss (\d+\.\d+)", result.stdout)]
    bridge_accuracy = [float(x) for x in re.findall(r"bridge: .*?val_accuracy (\d\.\d+)", result.stdout)]
    torch_accuracy = [float(x) for x in re.findall(r"torch: .*?val_accuracy (\d\.\d+)", result.stdout)]
    (exported,) = [float(x) for x in re.findall(r"inference model .*: test accuracy (\d\.\d+)", result.stdout)]
    assert len(bridge_losses) == len(bridge_accuracy) == len(torch_accuracy) == 4, result.stdout
    assert bridge_losses == sorted(bridge_losses, reverse=True), result.stdout  # the loss falls every epoch
    assert bridge_accuracy[-1] >= 0.95 and abs(bridge_accuracy[-1] - torch_accuracy[-1]) <= 0.01, result.stdout
    assert exported == bridge_accuracy[-1], result.stdout  # the same 397 test images, the same model
    written = {p.name for p in tmp_path.iterdir()}
    assert written >= {"digits.train.onnx", "digits.train.eval.onnx", "digits.train.gradient.onnx",
                       "digits.train.update.onnx", "digits.ckpt.npz", "digits.trained.onnx"}
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot: plotting needs matplotlib" in result.stdout
    else:
        assert (tmp_path / "digits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
