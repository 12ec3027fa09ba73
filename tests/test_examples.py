"""The example scripts run as documented and show what they claim."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_demo_loss_falls_and_warns_about_nothing(tmp_path):
    """The loss falls; neither onnxruntime nor Python warns about bridge's graphs (stderr stays empty)."""
    result = _run("examples/demo.py")
    losses = [float(x) for x in re.findall(r"mean loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] / 2, result.stdout
    assert result.stderr == ""


@pytest.mark.slow
def test_traverse_ir_follows_a_weight_to_its_update():
    out = _run("examples/traverse_ir.py").stdout
    assert "forward" in out and "backward" in out and "optimizer" in out
    assert "grad_conv2.weight" in out and "updated_conv2.weight" in out, out
