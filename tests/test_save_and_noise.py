"""``TrainingModel.save`` writes what ``Trainer(path)`` needs to train: the state beside the graphs."""
from pathlib import Path

import numpy as np
import onnx
import pytest

import bridge
from bridge.training.training_model import PARTS, part_path, state_file

MLP = Path(__file__).resolve().parents[1] / "examples" / "models" / "mlp.onnx"


def _batches(count, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((32, 8)).astype(np.float32), rng.integers(0, 3, 32).astype(np.int64))
            for _ in range(count)]


def test_trainer_on_a_saved_file_continues_from_the_saved_state(tmp_path):
    """Train 3 steps in memory, save with that state, train 3 more from the file: the same losses and
    state, to the bit, as 3 more steps in memory (Adam: the moments and step count travel too)."""
    tm = bridge.to_training_onnx(MLP, loss="ce", optim="adam", optim_options={"lr": 0.01}, batch_size=32)
    first, then = _batches(3), _batches(3, seed=1)
    memory = bridge.Trainer(tm)
    for x, y in first:
        memory.step(x, y)
    tm.initial_values = {name: np.array(value) for name, value in memory.session.state.items()}
    tm.save(tmp_path / "train.onnx")
    assert state_file(tmp_path / "train.onnx").is_file()
    loaded = bridge.Trainer(tmp_path / "train.onnx")
    assert int(loaded.session.state["step"]) == 3
    want = [memory.step(x, y)["loss"] for x, y in then]
    got = [loaded.step(x, y)["loss"] for x, y in then]
    assert got == want and len(set(want)) == 3
    for name, value in memory.session.state.items():
        np.testing.assert_array_equal(loaded.session.state[name], value, err_msg=name)


def test_save_state_path_and_skipping_it(tmp_path):
    tm = bridge.to_training_onnx(MLP, loss="ce", optim="sgd", batch_size=32)
    tm.save(tmp_path / "a.onnx", state_path=tmp_path / "elsewhere.npz")
    assert (tmp_path / "elsewhere.npz").is_file() and not state_file(tmp_path / "a.onnx").exists()
    tm.save(tmp_path / "b.onnx", write_state=False)
    assert not state_file(tmp_path / "b.onnx").exists()
    with pytest.raises(bridge.training.trainer.ModelLoadError, match="no state"):
        bridge.Trainer(tmp_path / "b.onnx")
    with pytest.raises(bridge.InvalidOptionError, match="write_state=False"):
        tm.save(tmp_path / "c.onnx", state_path=tmp_path / "c.npz", write_state=False)
    assert not (tmp_path / "c.onnx").exists()


@pytest.mark.parametrize("optim", ["adam", "rmsprop"])
def test_saved_state_has_the_shapes_every_saved_graph_declares_and_steps_quietly(tmp_path, capfd, optim):
    """Each state array (``step`` and ``lr`` are 0-d) has exactly the shape its input declares in the
    step, eval, gradient and update graphs, so onnxruntime warns about no shape while Trainer(path)
    trains and evaluates."""
    tm = bridge.to_training_onnx(MLP, loss="ce", optim=optim, batch_size=32)
    path = tm.save(tmp_path / "train.onnx")
    state = dict(np.load(state_file(path)))
    assert state["step"].shape == () and state["lr"].shape == ()
    for graph_path in [path] + [part_path(path, part) for part in PARTS]:
        declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(graph_path).graph.input}
        if graph_path == path:
            assert state.keys() <= declared.keys()  # the step reads the whole state
        for name in declared.keys() & state.keys():
            assert list(state[name].shape) == declared[name], f"{graph_path.name}: {name}"
    capfd.readouterr()
    trainer = bridge.Trainer(path)
    (x, y), = _batches(1)
    losses = [trainer.step(x, y)["loss"] for _ in range(3)]
    trainer.evaluate((x, y))
    assert capfd.readouterr().err == "" and losses[-1] < losses[0]
