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
from onnx import numpy_helper

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


def _torch_steps(module, batches, noises, precision, scaler_options, lr, skips=None, batch_norm="train"):
    """Adam steps of ``module`` under autocast + GradScaler: per step the loss, the loss scale after it and
    whether the optimizer step was skipped. ``precision`` fp32: no autocast and no scaler, the optimizer step
    skipped where ``skips`` says (the float32 run of the same steps). ``batch_norm="frozen"``: its BatchNorms in
    ``eval()``, as bridge's option of that name trains them."""
    module = copy.deepcopy(module).train()
    for submodule in module.modules():
        if isinstance(submodule, torch.nn.modules.batchnorm._BatchNorm) and batch_norm == "frozen":
            submodule.eval()
    dropout = next((m for m in module.modules() if isinstance(m, _NoiseDropout)), None)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    mixed = precision != "fp32"
    scaler = torch.amp.GradScaler("cpu", enabled=mixed, **(scaler_options if mixed else {}))
    first = next(iter(module.parameters()))
    records = []
    for index, ((inputs, target), noise) in enumerate(zip(batches, noises, strict=True)):
        if dropout is not None:
            dropout.noise = torch.from_numpy(noise)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=DTYPES.get(precision, torch.float32), enabled=mixed):
            loss = F.cross_entropy(module(*(torch.from_numpy(v) for v in inputs.values())), torch.from_numpy(target))
        steps_before = optimizer.state[first]["step"].item() if first in optimizer.state else 0.0
        scaler.scale(loss).backward()
        if mixed or not skips[index]:
            scaler.step(optimizer)
        scaler.update()
        steps_after = optimizer.state[first]["step"].item() if first in optimizer.state else 0.0
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
    """bridge's steps, torch's mixed-precision steps, and torch's float32 steps skipping the same steps."""
    tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": lr}, precision=precision,
                                 grad_scaler_options=scaler_options, **convert)
    batch_norm = convert.get("batch_norm", "train")
    want = _torch_steps(module, batches, noises, precision, scaler_options, lr, batch_norm=batch_norm)
    float32 = _torch_steps(module, batches, noises, "fp32", scaler_options, lr, [r["skipped"] for r in want],
                           batch_norm=batch_norm)
    return _bridge_steps(tm, batches, noises), want, float32


def _assert_like_torch(got, want, float32):
    """The same skipped steps and scales; the losses within twice the low precision's noise: how far it takes
    torch's own losses from the float32 run of the same steps (measured per run). bridge's run and torch's each
    lie that far from float32, so they lie up to twice that far from each other."""
    assert [r["skipped"] for r in got] == [r["skipped"] for r in want]
    assert [r["scale"] for r in got] == [r["scale"] for r in want]
    noise = 2 * max(abs(w["loss"] - f["loss"]) for w, f in zip(want, float32, strict=True))
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


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_update_follows_grad_scaler_step_for_step(precision):
    """The update graph (optimizer + loss scaling) fed the same gradients as torch's GradScaler + Adam, some with
    an infinity or a NaN: the same skipped steps (weights, Adam state and step kept), the same scale after every
    step (backoff, growth every 3 good steps), the same weights within float32 noise."""
    tm = bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", loss="ce", optim="adam",
                                 optim_options={"lr": 0.01}, precision=precision,
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


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_forward_rounds_where_autocast_rounds(precision):
    """Linear -> Tanh -> Linear (Gemm, Tanh, Gemm in ONNX): the eval graph's low-precision forward gives torch
    autocast's output. Each Linear is one addmm rounded once (not a rounded product plus a rounded bias), and
    every node rounds to the low type as torch's kernels do, including where onnxruntime has no kernel of that
    type. What is left is float32 summation order: at most one unit in the last place of the low type."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    tm = bridge.to_training_onnx(module, "ce", "sgd", precision=precision, example_inputs=torch.from_numpy(x))
    got = tm.session().evaluate({tm.data_inputs[0]: x}, np.zeros(32, np.int64))[f"output_{tm.source.graph.output[0].name}"]
    with torch.no_grad(), torch.autocast("cpu", dtype=DTYPES[precision]):
        want = module(torch.from_numpy(x)).float().numpy()
    mantissa_bits = {"fp16": 10, "bf16": 7}[precision]
    unit = 2.0 ** (np.floor(np.log2(np.abs(want))) - mantissa_bits)
    assert np.all(np.abs(got - want) <= unit)
    assert np.mean(got == want) >= 0.99


# fp16 from 2**24 overflows at once and backs off step by step; growth every 3 good steps overflows again. bf16
# has float32's range: from 2**120 the scale grows until the next growth would be infinite, and stays there.
SCALER_OPTIONS = {"fp16": {"init_scale": 2.0 ** 24, "growth_interval": 3},
                  "bf16": {"init_scale": 2.0 ** 120, "growth_interval": 3}}


@needs_sklearn
@pytest.mark.slow
@pytest.mark.parametrize("batch_norm", ["train", "frozen"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_digits_cnn_follows_autocast_and_grad_scaler(precision, batch_norm):
    """24 Adam steps of the digits CNN (Conv, BatchNorm, Dropout, Linear) on the digits: skips, scales and losses
    as torch's autocast + GradScaler; with ``batch_norm="frozen"``, as torch's with the BatchNorm in ``eval()``."""
    digits = _digits_example()
    module = digits.cnn_module()
    source = digits.cnn_onnx(module)
    module[4] = _NoiseDropout(module[4].p)
    # the training-mode export's trace moved the running statistics it wrote; frozen, torch normalizes with those
    module[1].load_state_dict({k: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in source.graph.initializer
                               for k in ("running_mean", "running_var") if t.name == f"1.{k}"}, strict=False)
    batches, noises = _digits_batches(digits, 24)
    got, want, float32 = _compare(module, source, batches, noises, precision, SCALER_OPTIONS[precision], 0.01,
                                  batch_size=64, dynamic_batch=False, batch_norm=batch_norm)
    _assert_like_torch(got, want, float32)
    if precision == "fp16":
        assert any(r["skipped"] for r in want) and not all(r["skipped"] for r in want)
    assert len({r["scale"] for r in want}) > 2  # the scale moved both ways (fp16) or grew (bf16)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_bert_tiny_follows_autocast_and_grad_scaler(precision):
    """24 Adam steps of the zoo's bert_tiny (a torch module source) on random token batches: skips, scales and
    losses as torch's autocast + GradScaler."""
    from tests.zoo import torch_models

    module, inputs, target, _ = torch_models.bert()
    rng = np.random.default_rng(1)
    batches = [({"input_ids": rng.integers(1, torch_models.VOCAB, inputs["input_ids"].shape).astype(np.int64),
                 "attention_mask": inputs["attention_mask"]}, rng.integers(0, 3, target.shape).astype(np.int64))
               for _ in range(24)]
    example = tuple(torch.from_numpy(value) for value in inputs.values())
    got, want, float32 = _compare(module, module, batches, [None] * len(batches), precision, SCALER_OPTIONS[precision],
                                  0.01, example_inputs=example)
    _assert_like_torch(got, want, float32)
    if precision == "fp16":
        assert any(r["skipped"] for r in want) and not all(r["skipped"] for r in want)


def test_options_are_checked():
    with pytest.raises(InvalidOptionError, match="precision='fp8'"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp8")
    with pytest.raises(InvalidOptionError, match="growth_interval"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp16",
                                grad_scaler_options={"growth_interval": 0})
    with pytest.raises(InvalidOptionError, match="unknown grad_scaler_options"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="fp16",
                                grad_scaler_options={"scale": 2.0})
    with pytest.raises(InvalidOptionError, match="growth factor"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="bf16",
                                grad_scaler_options={"growth_factor": 0.5})
    with pytest.raises(InvalidOptionError, match="init_scale"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", precision="bf16",
                                grad_scaler_options={"init_scale": -1.0})
    with pytest.raises(InvalidOptionError, match="mixed precision"):
        bridge.to_training_onnx(ROOT / "examples" / "models" / "mlp.onnx", grad_scaler_options={"init_scale": 2.0})


@needs_sklearn
@pytest.mark.slow
def test_digits_accuracy_matches_float32():
    """The digits CNN trained 4 epochs (Adam, batch 64) in fp16 and bf16 classifies the test split within
    0.5 points of the same training in float32."""
    digits = _digits_example()
    (images, labels), (test_images, test_labels) = digits.digits()
    source = digits.cnn_onnx(digits.cnn_module())
    accuracy = {}
    for precision in ("fp32", "fp16", "bf16"):
        tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": 0.01}, precision=precision,
                                     batch_size=64, dynamic_batch=False)
        session = tm.session(seed=0)
        for _ in range(4):
            for start in range(0, len(images) - 63, 64):
                session.step({"image": images[start:start + 64]}, labels[start:start + 64])
        correct = 0
        for start in range(0, len(test_images) - 63, 64):
            logits = session.evaluate({"image": test_images[start:start + 64]}, test_labels[start:start + 64])
            correct += int((np.argmax(logits["output_logits"], 1) == test_labels[start:start + 64]).sum())
        accuracy[precision] = 100 * correct / (len(test_images) // 64 * 64)
    assert accuracy["fp32"] >= 90, accuracy
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.5, accuracy
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.5, accuracy


@pytest.mark.slow
def test_bert_tiny_accuracy_matches_float32():
    """The zoo's bert_tiny trained 2 epochs (Adam, batch 16) in fp16 and bf16 on a task that needs attention
    (the class counts which of the first two tokens lie above the vocabulary's middle) classifies held-out
    sequences within 0.5 points of the same training in float32."""
    from tests.zoo import torch_models

    module, _, _, _ = torch_models.bert()
    batch, middle = 16, torch_models.VOCAB // 2

    def sequences(count, seed):
        ids = np.random.default_rng(seed).integers(1, torch_models.VOCAB, (count, torch_models.SEQ)).astype(np.int64)
        return ids, (ids[:, :2] > middle).sum(1).astype(np.int64)

    (ids, labels), (test_ids, test_labels) = sequences(batch * 200, 0), sequences(512, 1)
    mask = np.ones((batch, torch_models.SEQ), np.int64)
    accuracy = {}
    for precision in ("fp32", "fp16", "bf16"):
        tm = bridge.to_training_onnx(module, loss="ce", optim="adam", optim_options={"lr": 0.003}, precision=precision,
                                     example_inputs=(torch.from_numpy(ids[:batch]), torch.from_numpy(mask)))
        session = tm.session(seed=0)
        for _ in range(2):
            for start in range(0, len(ids), batch):
                session.step({"input_ids": ids[start:start + batch], "attention_mask": mask}, labels[start:start + batch])
        correct = 0
        for start in range(0, len(test_ids), batch):
            rows = slice(start, start + batch)
            logits = session.evaluate({"input_ids": test_ids[rows], "attention_mask": mask}, test_labels[rows])
            correct += int((np.argmax(logits[f"output_{tm.source.graph.output[0].name}"], 1) == test_labels[rows]).sum())
        accuracy[precision] = 100 * correct / len(test_ids)
    assert accuracy["fp32"] >= 90, accuracy
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.5, accuracy
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.5, accuracy


def test_cli_convert_takes_a_precision(tmp_path):
    from bridge.cli import main

    out = tmp_path / "mixed.onnx"
    assert main(["convert", str(ROOT / "examples" / "models" / "mlp.onnx"), "--loss", "ce", "--precision", "fp16",
                 "--grad-scaler-options", '{"init_scale": 8.0}', "-o", str(out)]) == 0
    state = np.load(tmp_path / "mixed.state.npz")
    assert float(state["loss_scale"]) == 8.0 and float(state["loss_scale_growth_tracker"]) == 0.0
