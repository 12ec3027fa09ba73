"""bridge.Trainer on IREE: trains like onnxruntime, resumes bit for bit from its own checkpoint,
and its checkpoints load into an onnxruntime session of the same graph (same graph hash)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.reference import assert_steps_match
from lifecycle_models import features, small_mlp

import bridge

pytest.importorskip("iree.runtime")
pytestmark = pytest.mark.slow


def test_iree_trainer_matches_onnxruntime_and_resumes(tmp_path):
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.05})
    data = features(14, seed=1)
    options = {"schedule": "step", "schedule_options": {"step_size": 1, "gamma": 0.5}, "seed": 3}
    iree = bridge.Trainer(tm, backend="iree", **options)
    iree.fit(data, epochs=1, batch_size=4)
    path = iree.save_checkpoint(tmp_path / "iree.npz")
    iree.fit(data, epochs=1, batch_size=4)

    ort = bridge.Trainer(tm, **options)
    ort.fit(data, epochs=2, batch_size=4)
    assert_steps_match([{"loss": s["loss"]} for s in iree.history.steps], [{"loss": s["loss"]} for s in ort.history.steps])
    assert [s["lr"] for s in iree.history.steps] == [s["lr"] for s in ort.history.steps]

    resumed = bridge.Trainer(tm, backend="iree", **options)
    resumed.load_checkpoint(path)
    resumed.fit(data, epochs=1, batch_size=4)
    assert resumed.history.steps == iree.history.steps
    assert all(np.array_equal(resumed.state()[k], v) for k, v in iree.state().items())

    from_iree = bridge.Trainer(tm, **options)
    from_iree.load_checkpoint(path)  # an onnxruntime session accepts the IREE checkpoint: one graph, one hash
    assert from_iree.epoch == 1 and set(from_iree.evaluate(data)) == {"loss", "accuracy", "samples"}


def test_iree_accumulation_runs_the_compiled_halves():
    """With ``accumulation_steps``, an IREE trainer runs the gradient and update graphs compiled by
    IREE (not onnxruntime), and trains as the onnxruntime trainer does."""
    from bridge.training.runtime_iree import IreeGraph

    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.05})
    data = features(16, seed=2)
    iree = bridge.Trainer(tm, backend="iree", accumulation_steps=2, seed=1)
    split = iree.session.split_step
    assert isinstance(split.gradient, IreeGraph) and isinstance(split.update, IreeGraph)
    iree.fit(data, epochs=1, batch_size=4)
    ort = bridge.Trainer(tm, accumulation_steps=2, seed=1)
    ort.fit(data, epochs=1, batch_size=4)
    assert_steps_match([{"loss": s["loss"]} for s in iree.history.steps], [{"loss": s["loss"]} for s in ort.history.steps])
    assert_steps_match([iree.state()], [ort.state()])
