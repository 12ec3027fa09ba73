"""bridge.Trainer: lr schedules equal to torch.optim.lr_scheduler's, fit/evaluate against a torch
training loop, batching (dynamic and static), checkpoints and resuming, loading from files."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from lifecycle_models import assert_close_to_float64, batch, features, small_cnn, small_mlp

import bridge
from bridge.training.runtime import OrtGraph

EPOCHS, SAMPLES, BATCH = 3, 20, 6  # 4 batches per epoch, the last one partial (2 samples)
LR = 0.1


@pytest.fixture(scope="module")
def mlp():
    module, model = small_mlp()
    return module, bridge.to_training_onnx(model, loss="ce", optim="sgd", optim_options={"lr": LR},
                                           extra_outputs=True)


def _torch_fit(module, data, schedule, options, interval, dtype):
    """torch's own loop: SGD + the lr_scheduler, unshuffled batches; per-step (lr, loss)."""
    module = copy.deepcopy(module).to(dtype)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    scheduler = schedule(optimizer) if callable(schedule) else getattr(torch.optim.lr_scheduler, schedule)(
        optimizer, **options)
    x, y = torch.from_numpy(data[0]).to(dtype), torch.from_numpy(data[1])
    records = []
    for _ in range(EPOCHS):
        for start in range(0, SAMPLES, BATCH):
            optimizer.zero_grad()
            loss = F.cross_entropy(module(x[start:start + BATCH]), y[start:start + BATCH])
            loss.backward()
            records.append((optimizer.param_groups[0]["lr"], loss.item()))
            optimizer.step()
            if interval == "step":
                scheduler.step()
        if interval == "epoch":
            scheduler.step()
    return records


SCHEDULE_CASES = {
    "step": ("StepLR", {"step_size": 2, "gamma": 0.5}, "epoch"),
    "multistep": ("MultiStepLR", {"milestones": [1, 2], "gamma": 0.3}, "epoch"),
    "cosine": ("CosineAnnealingLR", {"T_max": 2, "eta_min": 0.01}, "epoch"),
    "linear_warmup": ("LinearLR", {"start_factor": 0.1, "total_iters": 5}, "step"),
    "onecycle": ("OneCycleLR", {"max_lr": 0.3, "total_steps": 12}, "step"),
}


@pytest.mark.parametrize("name", list(SCHEDULE_CASES))
def test_schedule_lr_sequence_and_losses_equal_torch(mlp, name):
    module, tm = mlp
    torch_class, options, interval = SCHEDULE_CASES[name]
    data = features(SAMPLES, seed=1)
    trainer = bridge.Trainer(tm, schedule=name, schedule_options=options)
    trainer.fit(data, epochs=EPOCHS, batch_size=BATCH, shuffle=False)
    want_options = {**options, "cycle_momentum": False} if name == "onecycle" else options
    want32, want64 = (_torch_fit(module, data, torch_class, want_options, interval, d)
                      for d in (torch.float32, torch.float64))
    got_lr = np.array([s["lr"] for s in trainer.history.steps])
    np.testing.assert_array_equal(got_lr, np.float32([lr for lr, _ in want64]))
    assert_close_to_float64(np.array([s["loss"] for s in trainer.history.steps]),
                            np.array([loss for _, loss in want32]), np.array([loss for _, loss in want64]))


def test_callable_schedule_is_called_with_the_position(mlp):
    _, tm = mlp
    trainer = bridge.Trainer(tm, schedule=lambda epoch: LR / (1 + epoch))
    trainer.fit(features(SAMPLES, seed=2), epochs=EPOCHS, batch_size=BATCH)
    assert trainer.history["lr"] == [LR / (1 + e) for e in range(EPOCHS)]
    assert [s["lr"] for s in trainer.history.steps[::4]] == [float(np.float32(LR / (1 + e))) for e in range(EPOCHS)]


def test_unknown_schedule_and_cycled_momentum_are_refused(mlp):
    _, tm = mlp
    with pytest.raises(bridge.InvalidOptionError, match="schedule='warmup' is not one of"):
        bridge.Trainer(tm, schedule="warmup")
    with pytest.raises(bridge.InvalidOptionError, match="cycle_momentum=True needs a live momentum"):
        bridge.Trainer(tm, schedule="onecycle", schedule_options={"max_lr": 1, "total_steps": 4, "cycle_momentum": True})
    with pytest.raises(bridge.InvalidOptionError, match="StepLR"):
        bridge.Trainer(tm, schedule="step", schedule_options={"gamma": 0.5})


def test_fit_metrics_and_dynamic_partial_batch(mlp):
    module, tm = mlp
    data, validation = features(SAMPLES, seed=3), features(9, seed=4)
    trainer = bridge.Trainer(tm, seed=5)
    history = trainer.fit(data, epochs=2, batch_size=BATCH, validation=validation)
    assert len(trainer.history.steps) == 2 * 4 and history["samples"] == [SAMPLES, SAMPLES]
    assert history["dropped"] == [0, 0] and history["epoch"] == [1, 2]
    metrics = trainer.evaluate(validation, batch_size=4)
    assert metrics["samples"] == 9 and history["val_loss"][-1] == pytest.approx(metrics["loss"], rel=1e-6)
    trained = copy.deepcopy(module)
    trained.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state().items() if k in trained.state_dict()})
    with torch.no_grad():
        logits = trained(torch.from_numpy(validation[0]))
    want = float((logits.argmax(1).numpy() == validation[1]).mean())
    assert metrics["accuracy"] == want
    assert 0 <= history["accuracy"][0] <= 1


def test_static_batch_drops_the_last_partial_batch():
    _, model = small_cnn(dynamic=False)  # exported at batch 6
    trainer = bridge.Trainer(bridge.to_training_onnx(model, loss="ce", extra_outputs=True))
    inputs, target = batch(16, seed=6)
    history = trainer.fit((inputs, target), epochs=1)
    assert history["samples"] == [12] and history["dropped"] == [4] and len(trainer.history.steps) == 2
    with pytest.raises(bridge.InvalidOptionError, match="static batch size 6, not 4"):
        trainer.fit((inputs, target), batch_size=4)


def test_trainer_resume_is_bit_identical(tmp_path):
    _, model = small_cnn()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", extra_outputs=True)
    data = batch(14, seed=7)
    options = {"schedule": "onecycle", "schedule_options": {"max_lr": 0.05, "total_steps": 12}}
    first = bridge.Trainer(tm, seed=1, **options)
    first.fit(data, epochs=1, batch_size=4)
    path = first.save_checkpoint(tmp_path / "run.npz")
    first.fit(data, epochs=2, batch_size=4)
    resumed = bridge.Trainer(tm, seed=2, **options)
    resumed.load_checkpoint(path)
    resumed.fit(data, epochs=2, batch_size=4)
    assert resumed.history.steps == first.history.steps and resumed.history["epoch"] == [1, 2, 3]
    assert all(np.array_equal(resumed.state()[k], v) for k, v in first.state().items())


def test_trainer_from_files_and_export(mlp, tmp_path):
    _, tm = mlp
    path = tm.save(tmp_path / "mlp.onnx")  # writes mlp.state.npz beside it
    trainer = bridge.Trainer(path)
    data = features(SAMPLES, seed=8)
    trainer.fit(data, epochs=1, batch_size=BATCH)
    assert set(trainer.evaluate(data)) == {"loss", "accuracy", "samples"}
    with pytest.raises(bridge.InvalidOptionError, match="needs the source model"):
        trainer.export_inference(tmp_path / "out.onnx")
    with pytest.raises(bridge.ModelLoadError, match="no state for"):
        bridge.Trainer(tm.save(tmp_path / "other.onnx", write_state=False))
    in_memory = bridge.Trainer(tm)
    in_memory.fit(data, epochs=1, batch_size=BATCH)
    exported = in_memory.export_inference(tmp_path / "mlp.trained.onnx")
    (y,) = OrtGraph(onnx.load(str(exported)))({"x": data[0]}).values()
    np.testing.assert_allclose(y, in_memory.session.evaluate({"x": data[0]}, data[1])["output_y"], rtol=1e-6)


def test_cli_train_resume_and_export_inference(tmp_path):
    from bridge.cli import main

    _, model = small_mlp()
    source = tmp_path / "mlp.onnx"
    onnx.save(model, str(source))
    train = tmp_path / "train.onnx"
    assert main(["convert", str(source), "-o", str(train), "--loss", "ce", "--optim", "sgd",
                 "--optim-options", '{"lr": 0.1}']) == 0
    x, y = features(SAMPLES, seed=9)
    np.savez(tmp_path / "data.npz", x=x, target=y)
    common = ["--data", str(tmp_path / "data.npz"), "--batch-size", str(BATCH), "--schedule", "step",
              "--schedule-options", '{"step_size": 1, "gamma": 0.5}']
    assert main(["train", str(train), *common, "--epochs", "1", "--checkpoint", str(tmp_path / "one.npz")]) == 0
    assert main(["train", str(train), *common, "--epochs", "1", "--resume", str(tmp_path / "one.npz"),
                 "--checkpoint", str(tmp_path / "two.npz")]) == 0
    straight = bridge.Trainer(train, schedule="step", schedule_options={"step_size": 1, "gamma": 0.5})
    straight.fit((x, y), epochs=2, batch_size=BATCH)
    resumed = bridge.Trainer(train, schedule="step", schedule_options={"step_size": 1, "gamma": 0.5})
    resumed.load_checkpoint(tmp_path / "two.npz")
    assert resumed.history.steps == straight.history.steps
    out = tmp_path / "trained.onnx"
    assert main(["export-inference", str(source), "--train", str(train), "--checkpoint", str(tmp_path / "two.npz"),
                 "-o", str(out)]) == 0
    (got,) = OrtGraph(onnx.load(str(out)))({"x": x}).values()
    np.testing.assert_allclose(got, straight.session.evaluate({"x": x}, y)["output_y"], rtol=1e-6)
    assert main(["export-inference", str(source), "--train", str(tmp_path / "train.eval.onnx"),
                 "--checkpoint", str(tmp_path / "two.npz"), "-o", str(out)]) == 2


def test_skipped_nonfinite_steps_are_counted_and_change_nothing(mlp, capsys):
    _, tm = mlp
    trainer = bridge.Trainer(tm, schedule=lambda epoch: float("inf") if epoch == 1 else LR, on_nonfinite="skip",
                             progress=True)
    history = trainer.fit(features(SAMPLES, seed=10), epochs=1, batch_size=BATCH)
    after_first = trainer.state()
    history = trainer.fit(features(SAMPLES, seed=10), epochs=1, batch_size=BATCH)
    assert history["skipped"] == [0, 4]  # the forward ran (its loss counts), the updates were dropped
    assert all(np.array_equal(trainer.state()[k], v) for k, v in after_first.items() if k != "lr")
    assert "epoch=2" in capsys.readouterr().err
