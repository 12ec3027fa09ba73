"""LoRA training graphs (``to_training_onnx(lora=)``) compiled by IREE and onnx-mlir step as onnxruntime does.

An MLP and a CNN with Conv adapters (make test), bert_tiny and gpt2_tiny (make test-all; adapters on the
attention and MLP projections) are compiled and stepped 3 times (SGD with momentum), updates fed back; every
output (loss, grad_*, updated_*) is compared with onnxruntime at one thread (onnx-mlir runs on one), at
test_onnx_mlir.py's tolerance: 16 units of float32 rounding of each tensor's largest magnitude.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.reference import assert_steps_match
from lifecycle_models import LORA_TARGETS, lora_cnn
from zoo import torch_models

import bridge
from bridge.tools.target_check import onnx_mlir_missing

TOLERANCE = 16 * float(np.finfo(np.float32).eps)
STEPS = 3
_ONNX_MLIR_MISSING = onnx_mlir_missing()


def _mlp() -> torch_models.Built:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    rng = np.random.default_rng(0)
    return module, {"x": rng.standard_normal((4, 6)).astype(np.float32)}, rng.integers(0, 3, 4), "ce"


CASES = {"mlp": (_mlp, ["*"]), "cnn": (lora_cnn, LORA_TARGETS["cnn"]),
         "bert_tiny": (torch_models.bert, LORA_TARGETS["bert_tiny"]), "gpt2_tiny": (torch_models.gpt2, LORA_TARGETS["gpt2_tiny"])}
# the transformers compile for minutes in each compiler: the exhaustive tier (make test-all); CI compiles the MLP
# and the CNN
EXHAUSTIVE = {"bert_tiny", "gpt2_tiny"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    pytest.param("iree", marks=pytest.mark.iree),  # skipped without IREE (conftest.py)
    pytest.param("onnx-mlir", marks=[pytest.mark.onnx_mlir, pytest.mark.skipif(
        _ONNX_MLIR_MISSING is not None, reason=f"onnx-mlir is not available: {_ONNX_MLIR_MISSING}")])])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.exhaustive] if n in EXHAUSTIVE else []) for n in CASES])
def test_lora_graph_compiled_steps_like_onnxruntime(name, backend):
    build, targets = CASES[name]
    module, inputs, target, loss = build()
    # SGD with momentum: Adam's first step divides each gradient by its own magnitude, so a gradient element near
    # zero turns float32 rounding into an update of any size
    tm = bridge.to_training_onnx(module, loss, "sgd", optim_options={"lr": 0.1, "momentum": 0.9},
                                 example_inputs=tuple(torch.from_numpy(v) for v in inputs.values()),
                                 lora={"rank": 4, "alpha": 8, "targets": targets})
    feed = dict(zip(tm.data_inputs, inputs.values(), strict=True))
    compiled = tm.session(backend=backend, seed=0)
    reference = tm.session(threads=1, seed=0)
    got = [compiled.step(feed, target) for _ in range(STEPS)]
    want = [reference.step(feed, target) for _ in range(STEPS)]
    assert {key for key in want[0] if key.startswith("grad_")} == {f"grad_{n}" for n in tm.lora.adapter_names}
    assert_steps_match(got, want, rtol=TOLERANCE)
    assert float(want[-1]["loss"]) != float(want[0]["loss"])  # the adapters trained
