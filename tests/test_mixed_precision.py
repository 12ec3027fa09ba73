"""Mixed precision (``precision="fp16"/"bf16"``) against torch's autocast + ``torch.amp.GradScaler``.

The oracle is torch itself: the same module, the same initial weights, batches and Dropout masks, trained
under ``torch.autocast("cpu")`` with a GradScaler and torch.optim. The graph must skip the same steps, hold
the same loss scale after every step, and give losses within the low precision's noise (measured as how far
torch's own mixed-precision losses lie from its float32 ones on the same steps).
"""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bridge
from bridge.errors import InvalidOptionError

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NOISE = "/4/Dropout.noise"  # the digits CNN's Dropout noise input
needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed")


def _digits_example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import digits
    finally:
        sys.path.pop(0)
    return digits


class _NoiseDropout(torch.nn.Module):
    """torch's inverted Dropout with the mask drawn from given uniform noise (``noise >= p``), as bridge's
    graph draws it: both sides use the same masks."""

    def __init__(self, p: float):
        super().__init__()
        self.p, self.noise = p, None

    def forward(self, x):
        return x * (self.noise >= self.p).to(x.dtype) * (1 / (1 - self.p))


def _torch_steps(module, batches, noises, precision, scaler_options, lr):
    """Adam steps of ``module`` under autocast + GradScaler (``precision`` fp32: neither): per step the loss,
    the loss scale after it and whether the optimizer step was skipped."""
    module = copy.deepcopy(module).train()
    dropout = next((m for m in module.modules() if isinstance(m, _NoiseDropout)), None)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    mixed = precision != "fp32"
    scaler = torch.amp.GradScaler("cpu", enabled=mixed, **(scaler_options if mixed else {}))
    records = []
    for (inputs, target), noise in zip(batches, noises, strict=True):
        if dropout is not None:
            dropout.noise = torch.from_numpy(noise)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=DTYPES.get(precision, torch.float32), enabled=mixed):
            loss = F.cross_entropy(module(*(torch.from_numpy(v) for v in inputs.values())), torch.from_numpy(target))
        steps_before = optimizer.state[next(iter(module.parameters()))].get("step", torch.tensor(0.0)).item() \
            if optimizer.state else 0.0
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        steps_after = optimizer.state[next(iter(module.parameters()))]["step"].item() if optimizer.state else 0.0
        records.append({"loss": loss.item(), "scale": scaler.get_scale() if mixed else 1.0,
                        "skipped": steps_after == steps_before})
    return records


def _bridge_steps(tm, batches, noises):
    session = tm.session()
    records = []
    for (inputs, target), noise in zip(batches, noises, strict=True):
        step = float(session.state["step"])
        feed = {**inputs, NOISE: noise} if NOISE in {value.name for value in tm.model.graph.input} else dict(inputs)
        out = session.step(feed, target)
        records.append({"loss": float(out["loss"]), "scale": float(out.get("updated_loss_scale", 1.0)),
                        "skipped": float(out["updated_step"]) == step})
    return records


def _compare(module, source, batches, noises, precision, scaler_options, lr, **convert):
    tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": lr}, precision=precision,
                                 grad_scaler_options=scaler_options, **convert)
    got = _bridge_steps(tm, batches, noises)
    want = _torch_steps(module, batches, noises, precision, scaler_options, lr)
    float32 = _torch_steps(module, batches, noises, "fp32", scaler_options, lr)
    return got, want, float32


def _assert_like_torch(got, want, float32):
    assert [r["skipped"] for r in got] == [r["skipped"] for r in want]
    assert [r["scale"] for r in got] == [r["scale"] for r in want]
    assert any(r["skipped"] for r in want) and not all(r["skipped"] for r in want)  # the run tests both paths
    # the low precision's noise on this run: how far torch's own mixed-precision losses lie from float32's
    noise = max(abs(w["loss"] - f["loss"]) for w, f in zip(want, float32, strict=True))
    errors = [abs(g["loss"] - w["loss"]) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= noise, (errors, noise)


def _digits_batches(digits, count, batch=64, seed=0):
    (images, labels), _ = digits.digits()
    rng = np.random.default_rng(seed)
    batches, noises = [], []
    for index in range(count):
        rows = slice((index * batch) % (len(images) - batch), (index * batch) % (len(images) - batch) + batch)
        batches.append(({"image": images[rows]}, labels[rows]))
        noises.append(rng.random((batch, 8 * 8 * 8)).astype(np.float32))
    return batches, noises


def test_update_follows_grad_scaler_step_for_step():
    """The update graph (optimizer + loss scaling) fed the same gradients as torch's GradScaler + Adam, some with
    an infinity or a NaN: the same skipped steps (weights, Adam state and step kept), the same scale after every
    step (backoff, growth every 3 good steps), the same weights within float32 noise."""
    tm = bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", loss="ce", optim="adam",
                                 optim_options={"lr": 0.01}, precision="fp16",
                                 grad_scaler_options={"init_scale": 1024.0, "growth_interval": 3})
    import onnxruntime

    update = onnxruntime.InferenceSession(tm.update_model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [value.name for value in update.get_outputs()]
    state = tm.initial_state()
    params = {name: torch.nn.Parameter(torch.from_numpy(state[name].copy())) for name in tm.weights}
    optimizer = torch.optim.Adam(params.values(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    rng = np.random.default_rng(0)
    bad = {2: np.inf, 3: -np.inf, 7: np.nan, 12: np.inf}
    skipped = 0
    for index in range(16):
        grads = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in params.items()}
        if index in bad:
            next(iter(grads.values())).reshape(-1)[index] = bad[index]
        feed = {name: state[name] for name in state if name in {i.name for i in update.get_inputs()}}
        out = dict(zip(names, update.run(None, {**feed, **{f"grad_{n}": g for n, g in grads.items()}}), strict=True))
        state.update({name.removeprefix("updated_"): value for name, value in out.items()})
        scale = float(scaler.scale(torch.ones(())))  # the scale the loss would be multiplied by
        for name, param in params.items():
            param.grad = torch.from_numpy(grads[name]) * scale  # what backward of the scaled loss gives
        scaler.step(optimizer)
        scaler.update()
        skipped += index in bad
        assert float(state["loss_scale"]) == scaler.get_scale(), index
        assert float(state["step"]) == index + 1 - skipped, index
        for name, param in params.items():
            np.testing.assert_allclose(state[name], param.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
    assert skipped == len(bad)


@needs_sklearn
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="onnxruntime's graph optimizations (level basic) run some float16 nodes in "
                   "float32 without the rounding back, so a gradient torch overflows stays finite (seen on the "
                   "Linear's weight gradient at step 6): not yet step for step")
@pytest.mark.parametrize("precision", ["fp16"])
def test_digits_cnn_follows_autocast_and_grad_scaler(precision):
    """24 Adam steps from a loss scale of 2**24 (fp16 overflows at once: the scale backs off step by step) with
    growth every 3 good steps (it grows into overflow again): skips, scales and losses as torch's."""
    digits = _digits_example()
    module = digits.cnn_module()
    source = digits.cnn_onnx(module)
    module[4] = _NoiseDropout(module[4].p)
    batches, noises = _digits_batches(digits, 24)
    options = {"init_scale": 2.0 ** 24 if precision == "fp16" else 2.0 ** 124, "growth_interval": 3}
    got, want, float32 = _compare(module, source, batches, noises, precision, options, 0.01,
                                  batch_size=64, dynamic_batch=False)
    _assert_like_torch(got, want, float32)


def test_options_are_checked():
    with pytest.raises(InvalidOptionError, match="precision='fp8'"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp8")
    with pytest.raises(InvalidOptionError, match="growth_interval"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp16",
                                grad_scaler_options={"growth_interval": 0})
    with pytest.raises(InvalidOptionError, match="unknown grad_scaler_options"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp16",
                                grad_scaler_options={"scale": 2.0})
    with pytest.raises(InvalidOptionError, match="mixed precision"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", grad_scaler_options={"init_scale": 2.0})
