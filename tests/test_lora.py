"""LoRA adapters injected into an ONNX model (bridge/pipeline/lora.py) train as peft's LoRA does:
same initial adapters, same SGD steps, same losses and adapters; merging folds them into the base."""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper as nh

import bridge
from bridge.pipeline.lora import inject_lora, merge_lora

peft = pytest.importorskip("peft")
RANK, ALPHA, LR, STEPS = 4, 8.0, 0.1, 3


def _mlp_and_data():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["x"], output_names=["y"])
    return module, onnx.load_from_string(buffer.getvalue()), x, y


def _set(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> None:
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(nh.from_array(values[init.name].astype(np.float32), init.name))


def test_lora_mlp_trains_like_peft():
    module, model, x, y = _mlp_and_data()
    lora = peft.get_peft_model(copy.deepcopy(module), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0", "2"]))
    injected, plan = inject_lora(model, rank=RANK, alpha=ALPHA, targets=["0.weight", "2.weight"])
    assert sorted(a.weight for a in plan.adapters) == ["0.weight", "2.weight"]
    layers = {"0.weight": lora.base_model.model[0], "2.weight": lora.base_model.model[2]}
    _set(injected, {a.a: layers[a.weight].lora_A["default"].weight.detach().numpy() for a in plan.adapters})
    tm = bridge.to_training_onnx(injected, "mse", "sgd", optim_options={"lr": LR}, trainable=plan.adapter_names)
    assert sorted(tm.weights) == sorted(plan.adapter_names)

    optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=LR)
    session = tm.session(seed=0)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(lora(x), y)
        loss.backward()
        optimizer.step()
        got = session.step({"x": x.numpy()}, y.numpy())
        np.testing.assert_allclose(float(got["loss"]), loss.item(), rtol=1e-5, err_msg=f"step {step}")
    for adapter in plan.adapters:
        layer = layers[adapter.weight]
        for name, want in ((adapter.a, layer.lora_A["default"].weight), (adapter.b, layer.lora_B["default"].weight)):
            np.testing.assert_allclose(got[f"updated_{name}"], want.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert np.abs(got[f"updated_{plan.adapters[0].b}"]).max() > 0  # B left zero: the comparison would be vacuous

    merged = merge_lora(model, {k: got[f"updated_{k}"] for k in plan.adapter_names}, plan)
    want = lora(x).detach().numpy()
    run = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(run, want, rtol=1e-4, atol=1e-6)
