"""examples/digits.py: the lifecycle on real data (scikit-learn's digits) learns, and the exported
inference model classifies the test split as well as the eval graph did."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("sklearn")


@pytest.mark.slow
def test_digits_example_learns_and_exports(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "digits.py"), str(tmp_path)], capture_output=True,
                            text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    validation = [float(x) for x in re.findall(r"val_accuracy (\d\.\d+)", result.stdout)]
    (exported,) = [float(x) for x in re.findall(r"test accuracy (\d\.\d+)", result.stdout)]
    assert len(validation) == 4 and validation[-1] > 0.9, result.stdout
    assert exported == validation[-1], result.stdout  # the same 397 test images, the same model
    assert {p.name for p in tmp_path.iterdir()} >= {"digits.train.onnx", "digits.train.eval.onnx",
                                                    "digits.ckpt.npz", "digits.trained.onnx"}
