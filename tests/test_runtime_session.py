"""bridge.training.runtime.OrtGraph runs a graph through onnxruntime's private binding (no per-call feed
re-validation) and falls back to the public ``InferenceSession.run`` where a release lacks it; its
threads spin unless told not to."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.reference import assert_batches_unchanged, copied_batches, random_batches
from helpers.single_op import one_node_model
from onnx import TensorProto, helper

import bridge
from bridge.training.runtime import OrtGraph, session_options, unchecked_run


def _scaled_sum() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("Mul", ["s", "x"], ["z"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y")],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FEED = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.full((2, 3), 0.5, np.float32)}


def test_graph_runs_through_the_private_binding_and_matches_the_public_run():
    graph = OrtGraph(_scaled_sum())
    assert graph._run == graph.session._sess.run  # this onnxruntime has the binding: the fast path is taken
    want = graph.session.run(["z"], FEED)[0]
    np.testing.assert_array_equal(graph(FEED)["z"], want)
    np.testing.assert_array_equal(want, (FEED["x"] + FEED["y"]) * FEED["x"])


def test_a_session_without_the_private_binding_uses_the_public_run():
    class PublicOnly:
        def __init__(self, session: ort.InferenceSession):
            self.run = session.run

    session = ort.InferenceSession(_scaled_sum().SerializeToString(), providers=["CPUExecutionProvider"])
    run = unchecked_run(PublicOnly(session))
    assert run == session.run
    np.testing.assert_array_equal(run(["z"], FEED, None)[0], session.run(["z"], FEED)[0])


def test_threads_spin_unless_told_not_to():
    """onnxruntime's spinning intra-op threads by default (faster on cores of one's own); blocking
    ones with ``spinning=False`` (cores shared with other busy processes)."""
    spinning, blocking = session_options(2), session_options(2, spinning=False)
    assert spinning.intra_op_num_threads == blocking.intra_op_num_threads == 2
    with pytest.raises(RuntimeError, match="does not have configuration"):  # onnxruntime's default: spin
        spinning.get_session_config_entry("session.intra_op.allow_spinning")
    assert blocking.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_a_training_model_session_takes_threads_and_spinning():
    """``tm.session(threads=, spinning=)`` reaches onnxruntime and steps like the default session."""
    x, target = np.ones((2, 3), np.float32), np.zeros((2, 4), np.float32)
    model = one_node_model("MatMul", ["x", "w"], {"x": x}, {"w": np.full((3, 4), 0.5, np.float32)}, opset=17)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd")
    plain, blocking = tm.session(), tm.session(threads=1, spinning=False)
    assert blocking._graph.session.get_session_options().intra_op_num_threads == 1
    assert blocking._graph.session.get_session_options().get_session_config_entry(
        "session.intra_op.allow_spinning") == "0"
    np.testing.assert_array_equal(blocking.step({"x": x}, target)["updated_w"], plain.step({"x": x}, target)["updated_w"])


def test_a_session_without_gradients_steps_the_same():
    """``gradients=False``: no ``grad_*`` outputs (onnxruntime reuses their buffers), the same loss,
    outputs and updates bit for bit over several Adam steps; the caller's model keeps its outputs."""
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 5)).astype(np.float32)
    model = one_node_model("MatMul", ["x", "w"], {"x": x}, {"w": rng.standard_normal((3, 5)).astype(np.float32)},
                           opset=17)
    tm = bridge.to_training_onnx(model, loss="mse", optim="adam")
    outputs = [o.name for o in tm.model.graph.output]
    full, lean = tm.session(), tm.session(gradients=False)
    assert [o.name for o in tm.model.graph.output] == outputs and "grad_w" in outputs
    for _ in range(3):
        want, got = full.step({"x": x}, target), lean.step({"x": x}, target)
        assert set(got) == {name for name in want if not name.startswith("grad_")}
        for name, value in got.items():
            np.testing.assert_array_equal(value, want[name])
    assert not any(name.startswith("grad_") for name in bridge.Trainer(tm).session.output_names)
    with pytest.raises(bridge.InvalidOptionError, match="gradients='no'"):
        tm.session(gradients="no")  # a truthy string would have kept them silently


def test_a_trainer_takes_threads_and_spinning():
    """``Trainer(threads=, spinning=)`` reaches onnxruntime; with the IREE backend, which takes its threads
    from iree.runtime.flags, they are refused rather than ignored."""
    model = one_node_model("MatMul", ["x", "w"], {"x": np.ones((2, 3), np.float32)},
                           {"w": np.full((3, 4), 0.5, np.float32)}, opset=17)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd")
    options = bridge.Trainer(tm, threads=1, spinning=False).session._graph.session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(bridge.InvalidOptionError, match="iree.runtime.flags"):
        bridge.Trainer(tm, backend="iree", threads=1)


@pytest.mark.parametrize("options", [{"threads": 0}, {"threads": -1}, {"threads": "2"}, {"threads": 2.5},
                                     {"threads": True}, {"spinning": "no"}])
def test_bad_threads_or_spinning_are_refused_by_name(options):
    """A thread count that is not an integer >= 1, or a spinning flag that is not a bool, is refused by
    name before onnxruntime sees it (it took -1 silently and raised a pybind TypeError for "2")."""
    with pytest.raises(bridge.InvalidOptionError, match=next(iter(options))):
        session_options(**options)


def _batchnorm_mlp() -> bridge.TrainingModel:
    """Linear-BatchNorm-ReLU-Linear with Adam: weights, BatchNorm buffers, moments and the step counter."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                 torch.nn.Linear(16, 3))
    return bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=torch.randn(5, 6))


def _assert_same_state(got: bridge.TrainingSession, want: bridge.TrainingSession) -> None:
    assert set(got.state) == set(want.state)
    for name, value in want.state.items():
        np.testing.assert_array_equal(got.state[name], value, err_msg=name)


def test_swapped_buffers_step_the_same_and_alternate_between_two_buffers():
    """``swap_buffers=True``: the same outputs and state bit for bit as a session that allocates them; each
    updated value lands in one of two buffers per state value, the one the step did not read, and the
    caller's initial state is never written."""
    tm = _batchnorm_mlp()
    initial = tm.initial_state()
    kept = {name: value.copy() for name, value in initial.items()}
    plain = bridge.TrainingSession(tm.model, tm.initial_state(), gradients=False)
    swapped = bridge.TrainingSession(tm.model, initial, gradients=False, swap_buffers=True)
    updated = [name for name in swapped.output_names if name.startswith("updated_")]
    written = []
    for inputs, target in random_batches(tm, 4, classes=3):
        want, got = plain.step(inputs, target), swapped.step(inputs, target)
        assert set(got) == set(want)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        written.append({name: got[name] for name in updated})
    _assert_same_state(swapped, plain)
    for name in updated:  # steps 1 and 3 wrote one buffer, 2 and 4 the other
        assert np.shares_memory(written[0][name], written[2][name]) and np.shares_memory(written[1][name], written[3][name])
        assert not np.shares_memory(written[2][name], written[3][name])
    for name, value in kept.items():
        np.testing.assert_array_equal(initial[name], value, err_msg=name)


def test_swapped_buffers_keep_a_replaced_state_a_skipped_step_and_a_checkpoint(tmp_path):
    """State set from outside between steps (a new lr, a loaded checkpoint) is what the next step reads; a
    step skipped for a non-finite update leaves the state as it was, as without swapped buffers."""
    tm = _batchnorm_mlp()
    batches = random_batches(tm, 6, classes=3)
    plain = bridge.TrainingSession(tm.model, tm.initial_state(), on_nonfinite="skip")
    swapped = bridge.TrainingSession(tm.model, tm.initial_state(), on_nonfinite="skip", swap_buffers=True)
    for session in (plain, swapped):
        session.step(*batches[0])
        session.step(*batches[1])
    checkpoint = swapped.save_checkpoint(tmp_path / "after2.npz")
    for session in (plain, swapped):
        session.lr = float("inf")  # every weight's update is not finite: skipped
        session.step(*batches[2])
        assert session.skipped_steps == 1
        session.lr = 1e-2
        session.step(*batches[3])
    _assert_same_state(swapped, plain)
    swapped.load_checkpoint(checkpoint)
    resumed = bridge.TrainingSession(tm.model, tm.initial_state())
    resumed.load_checkpoint(checkpoint)
    for batch in batches[4:]:
        want, got = resumed.step(*batch), swapped.step(*batch)
        np.testing.assert_array_equal(got["loss"], want["loss"])
    _assert_same_state(swapped, resumed)


def test_swapped_buffers_follow_a_changing_batch():
    """A graph with a symbolic batch fed batches of changing sizes: the model's output takes each step's batch
    size and the results match a session that allocates them, while the state keeps going into its two
    buffers."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    tm = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=torch.randn(5, 6), dynamic_batch=True,
                                 extra_outputs=True)
    plain = bridge.TrainingSession(tm.model, tm.initial_state(), gradients=False)
    swapped = bridge.TrainingSession(tm.model, tm.initial_state(), gradients=False, swap_buffers=True)
    rng = np.random.default_rng(0)
    for size in (3, 7, 2, 7):
        inputs = {name: rng.standard_normal((size, 6)).astype(np.float32) for name in tm.data_inputs}
        target = rng.integers(0, 3, size)
        want, got = plain.step(inputs, target), swapped.step(inputs, target)
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert [value.shape[0] for name, value in got.items() if name.startswith("output_")] == [size]
    _assert_same_state(swapped, plain)


def test_bad_swap_buffers_is_refused_by_name():
    tm = _batchnorm_mlp()
    with pytest.raises(bridge.InvalidOptionError, match="swap_buffers='yes'"):
        bridge.TrainingSession(tm.model, tm.initial_state(), swap_buffers="yes")


def _dropout_batchnorm_mlp() -> bridge.TrainingModel:
    """``_batchnorm_mlp`` with two Dropouts: noise inputs drawn each step, read by the first piece of an
    in_place step."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                 torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    return bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=torch.randn(5, 6))


@pytest.mark.parametrize("gradients", [True, False])
def test_in_place_steps_the_same_and_leaves_the_given_arrays_alone(gradients):
    """``in_place=True``: every output (loss, ``grad_*``, every ``updated_*``) and the state after 3 steps equal a
    plain session's bit for bit, Dropout noise included; the caller's initial state and batches are not written."""
    tm = _dropout_batchnorm_mlp()
    initial = tm.initial_state()
    kept = {name: value.copy() for name, value in initial.items()}
    batches = random_batches(tm, 3, classes=3)
    fed = copied_batches(batches)
    plain = bridge.TrainingSession(tm.model, tm.initial_state(), seed=0, gradients=gradients)
    in_place = bridge.TrainingSession(tm.model, initial, seed=0, gradients=gradients, in_place=True)
    assert len(in_place.random_inputs) == 2 and set(in_place.in_place) >= set(tm.weights)
    for inputs, target in batches:
        want, got = plain.step(inputs, target), in_place.step(inputs, target)
        assert set(got) == set(want) and any(name.startswith("grad_") for name in got) == gradients
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    _assert_same_state(in_place, plain)
    for name, value in kept.items():
        np.testing.assert_array_equal(initial[name], value, err_msg=name)
    assert_batches_unchanged(batches, fed)


@pytest.mark.parametrize(("options", "match"), [({"in_place": "yes"}, "in_place='yes'"),
                                                ({"in_place": True, "swap_buffers": True}, "swap_buffers=True"),
                                                ({"in_place": True, "on_nonfinite": "skip"}, "on_nonfinite='skip'")])
def test_in_place_refuses_what_it_cannot_keep(options, match):
    """A non-bool ``in_place``, and with it a second set of state buffers or skipping a non-finite step (the old
    state is gone after a step), are refused by name."""
    tm = _batchnorm_mlp()
    with pytest.raises(bridge.InvalidOptionError, match=match):
        bridge.TrainingSession(tm.model, tm.initial_state(), **options)


def test_in_place_step_holds_no_old_state_past_the_piece_that_last_reads_it():
    """During an in_place step, when a piece starts, no old state array and no value passed between pieces that
    an earlier piece last read is alive anywhere in the process (weak references to them are dead)."""
    import gc
    import weakref

    tm = _batchnorm_mlp()
    session = bridge.TrainingSession(tm.model, tm.initial_state(), gradients=False, in_place=True)
    batch = random_batches(tm, 1, classes=3)[0]
    session.step(*batch)  # from here the session's state is onnxruntime's output arrays, held by nothing else
    pieces = session._piecewise.pieces
    last_reader = {name: index for index, piece in enumerate(pieces) for name in piece.input_names}
    watched = {name: weakref.ref(session.state[name]) for name in session.in_place}
    alive_too_long: list[tuple[int, str]] = []
    for index, piece in enumerate(pieces):
        graph = piece.session
        inner = graph._run

        def run_piece(names: list[str], feed: dict, options, index: int = index, inner=inner) -> list:
            gc.collect()
            alive_too_long.extend((index, name) for name, ref in watched.items()
                                  if last_reader.get(name, len(pieces)) < index and ref() is not None)
            results = inner(names, feed, options)
            watched.update({name: weakref.ref(value) for name, value in zip(names, results, strict=True)
                            if name not in session.output_names})
            return results

        graph._run = run_piece
    assert sum(bool(names) for names in session._piecewise.state_released) > 2  # state released piece by piece
    session.step(*batch)
    assert not alive_too_long


def test_in_place_step_that_fails_after_releasing_state_says_the_state_is_lost():
    """A piece that fails after earlier pieces released old state: a ``StepStateLostError`` naming the piece and
    saying to restore the state (a later step would miss it), not onnxruntime's own error."""
    tm = _batchnorm_mlp()
    session = bridge.TrainingSession(tm.model, tm.initial_state(), in_place=True)
    failing = 1 + next(index for index, names in enumerate(session._piecewise.state_released) if names)

    def out_of_memory(*_arguments):
        raise RuntimeError("out of memory")

    session._piecewise.pieces[failing].session._run = out_of_memory
    with pytest.raises(bridge.StepStateLostError, match=f"piece {failing} of the step failed .*restore the state"):
        session.step(*random_batches(tm, 1, classes=3)[0])
