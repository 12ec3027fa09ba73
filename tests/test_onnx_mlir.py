"""Training graphs compiled by onnx-mlir (``bridge.compile(backend="onnx-mlir")``) train like onnxruntime.

An MLP (symbolic batch, adam), a CNN (Conv/BatchNorm/MaxPool/Dropout, static batch, SGD with
momentum) and a 1x1-conv head on a global pool (symbolic batch, adam) are compiled once per module and stepped 3 times with their updates fed back; every
output (loss, grad_*, updated_*) is compared with the same steps in onnxruntime at one thread (onnx-mlir
runs on one), which tests/test_*.py compare with PyTorch. The tolerance, ``TOLERANCE``, is 16 units
of float32 rounding (``eps``) of each tensor's largest magnitude: the largest deviation measured on
these graphs, element by element over every output and step, was 3.6 units (the MLP's
``updated_0.weight.exp_avg_sq``; the CNN's 3.4, its running mean and momentum buffer).
"""
from __future__ import annotations

import io
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import pytest
import torch
from helpers.reference import assert_batches_unchanged, assert_steps_match, copied_batches, steps_with_state_edits
from lifecycle_models import features, small_mlp
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.cli import main as cli_main
from bridge.tools.target_check import onnx_mlir_missing
from bridge.training.runtime_onnx_mlir import OnnxMlirGraph, OnnxMlirNotFoundError, OnnxMlirTrainingSession, find_onnx_mlir

TOLERANCE = 16 * float(np.finfo(np.float32).eps)


_MISSING = onnx_mlir_missing()
pytestmark = pytest.mark.onnx_mlir
needs_onnx_mlir = pytest.mark.skipif(_MISSING is not None, reason=f"onnx-mlir is not available: {_MISSING}")


def _export(module: torch.nn.Module, shape: tuple[int, ...], dynamic: bool) -> onnx.ModelProto:
    """``module`` exported in training mode (BatchNorm and Dropout stay nodes), input ``x``, output ``y``."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), (torch.randn(shape),), buffer, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}} if dynamic else None)
    return onnx.load_from_string(buffer.getvalue())


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _cnn() -> torch.nn.Module:
    # no conv bias: before BatchNorm its gradient is exactly zero, and each backend returns its own rounding noise
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Dropout(0.25), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3),
    )


def _pooled_head() -> torch.nn.Module:
    """A classifier head on a global pool (lcnet's ``conv_head``, a squeeze-excitation's reduce): its 1x1
    Conv's weight gradient is a MatMul of the batch-transposed gradient (the onnxruntime target's form),
    which onnx-mlir got wrong with a symbolic batch until ``bridge.compile`` copied that operand."""
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Conv2d(8, 16, 1), torch.nn.Hardswish(),
                               torch.nn.Flatten(), torch.nn.Linear(16, 3))


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]
    dynamic: bool
    optim: str
    options: dict
    sizes: tuple[int, ...]  # the batch size of each step
    convert: dict = field(default_factory=dict)  # more to_training_onnx arguments


CASES = {
    "mlp-symbolic-batch": Case(_mlp, (4, 6), True, "adam", {"lr": 0.05}, (5, 3, 5)),
    "cnn": Case(_cnn, (4, 1, 8, 8), False, "sgd", {"lr": 0.05, "momentum": 0.9}, (4, 4, 4)),
    "cnn-frozen-batch-norm": Case(_cnn, (4, 1, 8, 8), False, "adam", {"lr": 0.05}, (4, 4, 4), {"batch_norm": "frozen"}),
    "pooled-head-symbolic-batch": Case(_pooled_head, (4, 8, 2, 2), True, "adam", {"lr": 0.05}, (5, 3, 5)),
}


@dataclass
class Compiled:
    tm: bridge.TrainingModel
    compiled: bridge.CompiledModel
    case: Case


@pytest.fixture(scope="module", params=list(CASES))
def compiled(request) -> Compiled:
    if _MISSING is not None:
        pytest.skip(f"onnx-mlir is not available: {_MISSING}")
    case = CASES[request.param]
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options, dynamic_batch=case.dynamic, **case.convert)
    return Compiled(tm, bridge.compile(tm, backend="onnx-mlir"), case)


def _batches(session, case: Case, seed: int = 1) -> list:
    """Random batches of ``case``'s sizes, the Dropout noise given (so both backends see the same)."""
    rng = np.random.default_rng(seed)
    batches = []
    for size in case.sizes:
        inputs = {"x": rng.standard_normal((size, *case.shape[1:])).astype(np.float32)}
        for name, (shape, dtype) in session.random_inputs.items():
            inputs[name] = rng.random([d if isinstance(d, int) else size for d in shape]).astype(dtype)
        batches.append((inputs, rng.integers(0, 3, size).astype(np.int64)))
    return batches


@needs_onnx_mlir
def test_compiled_steps_match_onnxruntime(compiled):
    """3 steps, updates fed back, every output against onnxruntime at one thread (a symbolic batch:
    one .so stepped at batch sizes 5, 3, 5)."""
    session = compiled.compiled.session()
    assert isinstance(session, OnnxMlirTrainingSession)
    if compiled.case.build is _cnn:
        assert list(session.random_inputs), "the CNN's Dropout has a noise input"
    ort = compiled.tm.session(threads=1)
    batches = _batches(session, compiled.case)
    got = [session.step(inputs, target) for inputs, target in batches]
    want = [ort.step(inputs, target) for inputs, target in batches]
    assert set(got[0]) == set(want[0]) == {o.name for o in compiled.tm.model.graph.output}
    assert_steps_match(got, want, rtol=TOLERANCE)


@needs_onnx_mlir
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic-batch"])
def test_a_cnn_in_pieces_steps_like_onnxruntime_and_like_one_piece(dynamic, tmp_path):
    """The CNN compiled in 3 pieces (run in sequence, each fed what earlier ones made): 3 steps, updates fed
    back (symbolic batch: sizes 5, 3, 5 from one compile), match onnxruntime and equal the one-piece
    library's bit for bit, since onnx-mlir lowers each op to its own loops whichever graph holds it (a cut
    between ops changes no arithmetic). The pieces saved to one file and loaded from it step the same."""
    case = replace(CASES["cnn"], dynamic=dynamic, sizes=(5, 3, 5) if dynamic else (4, 4, 4))
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options, dynamic_batch=case.dynamic, **case.convert)
    whole, pieces = (bridge.compile(tm, backend="onnx-mlir", pieces=count) for count in (1, 3))
    saved = OnnxMlirTrainingSession(pieces.save(tmp_path / "train.zip"), tm.initial_state(), training_model=tm.model)
    sessions = [pieces.session(), saved, whole.session(), tm.session(threads=1)]
    batches = _batches(sessions[0], case)
    in_pieces, loaded, one_piece, ort = ([session.step(inputs, target) for inputs, target in batches] for session in sessions)
    assert_steps_match(in_pieces, ort, rtol=TOLERANCE)
    for got in (loaded, one_piece):
        for step, want in zip(got, in_pieces, strict=True):
            assert set(step) == set(want)
            for name, value in want.items():
                np.testing.assert_array_equal(step[name], value, err_msg=name)


def test_a_step_in_pieces_drops_each_value_after_its_last_reader():
    """A value a piece computes is dropped once the last piece that reads it has run (one no piece reads:
    at once); the graph's outputs and inputs are kept, but for the inputs named (``in_place``'s state)."""
    from types import SimpleNamespace

    from bridge.training.piecewise import released_after

    pieces = [SimpleNamespace(input_names=["x", "w"], output_names=["a", "b", "unread", "loss"]),
              SimpleNamespace(input_names=["a", "w"], output_names=["c"]),
              SimpleNamespace(input_names=["b", "c", "w"], output_names=["updated_w"])]
    assert released_after(pieces, ["loss", "updated_w"]) == [["unread"], ["a"], ["b", "c"]]
    assert released_after(pieces, ["loss", "updated_w"], ["w", "x"]) == [["x"], [], ["w"]]


@needs_onnx_mlir
def test_in_place_steps_are_bit_identical_and_leave_the_given_arrays_alone():
    """``in_place=True`` (a graph in pieces, its optimizer phase cut further after state arrays' updates): every
    step (3 batches, then state edits between steps) equals the step of the graph compiled without it, bit for bit; the arrays given (initial state, batches) are
    not written; ``on_nonfinite="skip"`` is refused, and after a non-finite step under ``"raise"`` the error
    says so and the state holds that step's values."""
    case = CASES["mlp-symbolic-batch"]
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options, dynamic_batch=case.dynamic, **case.convert)
    plain, in_place = (bridge.compile(tm, backend="onnx-mlir", pieces=3, in_place=flag) for flag in (False, True))
    initial = tm.initial_state()
    given = {name: value.copy() for name, value in initial.items()}
    sessions = [plain.session(seed=0), in_place.session(initial, seed=0)]
    assert set(sessions[1].in_place) == set(tm.weights) | {n for n in initial if n.startswith(tuple(tm.weights))} | {"step"}
    batches = _batches(sessions[0], case)
    fed = copied_batches(batches)
    steps = [[{name: value.copy() for name, value in session.step(inputs, target).items()} for inputs, target in batches]
             + steps_with_state_edits(session, tm.weights, *batches[0]) for session in sessions]
    for untied, tied in zip(*steps, strict=True):
        assert set(untied) == set(tied)
        for name in untied:
            np.testing.assert_array_equal(tied[name], untied[name], err_msg=name)
    for name, value in given.items():
        np.testing.assert_array_equal(initial[name], value, err_msg=name)
    assert_batches_unchanged(batches, fed)
    with pytest.raises(bridge.InvalidOptionError, match="on_nonfinite='skip'"):
        in_place.session(on_nonfinite="skip")
    session = sessions[1]
    session.lr = np.inf
    with pytest.raises(bridge.NonFiniteError, match="in place"):
        session.step(*batches[0])
    assert set(session.state) == set(initial)


@needs_onnx_mlir
def test_in_place_step_that_fails_after_releasing_state_says_the_state_is_lost():
    """A piece that fails after earlier pieces released in-place state: a ``StepStateLostError`` that names the
    piece and says to restore the state, not a plain runtime error (a later step would miss state)."""
    from types import SimpleNamespace

    case = CASES["mlp-symbolic-batch"]
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options, dynamic_batch=case.dynamic, **case.convert)
    session = bridge.compile(tm, backend="onnx-mlir", pieces=3, in_place=True).session(seed=0)
    first_release = next(index for index, names in enumerate(session._step.state_released) if names)
    failing = first_release + 1

    def out_of_memory(_inputs):
        raise RuntimeError("out of memory")

    session._pieces[failing] = SimpleNamespace(**{**vars(session._pieces[failing]), "session": SimpleNamespace(run=out_of_memory)})
    with pytest.raises(bridge.StepStateLostError, match=f"piece {failing} of the step failed .*restore the state"):
        session.step(*_batches(session, case)[0])


@needs_onnx_mlir
@pytest.mark.xfail(strict=True, raises=bridge.CompileError, reason="onnx-mlir's buffer reuse ignores element types")
def test_buffer_reuse_compiles_a_cast_to_float64():
    """onnx-mlir's ``--enable-krnl-buffer-reuse`` on the float64 cast of ``lr`` every Adam step has
    (tests/repros/onnx_mlir_buffer_reuse_cast.py); bridge does not pass the flag while this fails."""
    from repros.onnx_mlir_buffer_reuse_cast import BUFFER_REUSE, build

    bridge.compile(build(), backend="onnx-mlir", extra_args=(BUFFER_REUSE,))


def _run_in_onnxruntime(model: onnx.ModelProto, values: dict) -> dict:
    """``model``'s outputs by name, run in onnxruntime (1 thread) on the inputs it names from ``values``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output],
                    session.run(None, {i.name: values[i.name] for i in model.graph.input}), strict=True))


def _assert_pieces_compute_the_whole_graph(tm: bridge.TrainingModel, pieces: list, case: Case) -> None:
    """``pieces`` of ``tm``'s graph, each run in onnxruntime on the graph inputs and earlier pieces' outputs it
    names, give every graph output the whole graph gives (one batch of ``case``)."""
    inputs, target = _batches(tm.session(), case)[0]
    feed = {**tm.initial_state(), **inputs, "target": target}
    feed = {value.name: feed[value.name] for value in tm.model.graph.input}
    values = dict(feed)
    for piece in pieces:
        values.update(_run_in_onnxruntime(piece.model, values))
    whole = _run_in_onnxruntime(tm.model, feed)
    assert_steps_match([{name: values[name] for name in whole}], [whole], rtol=TOLERANCE)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_pieces_run_in_sequence_compute_the_whole_graph(count):
    """A training graph cut into pieces (``bridge.tools.pieces.split``), each run in onnxruntime on the graph
    inputs and earlier pieces' outputs it names, gives every graph output the whole graph gives."""
    from bridge.tools.pieces import split

    case = CASES["cnn"]
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options)
    pieces = split(tm.model, count)
    assert len(pieces) == count
    _assert_pieces_compute_the_whole_graph(tm, pieces, case)


@pytest.mark.parametrize("layer_tags", ["as converted", "all one layer"])
def test_in_place_pieces_each_replace_a_bounded_share_of_the_state(layer_tags):
    """in_place's cuts (``split(..., state_share=STATE_SHARE_PER_PIECE)``) of a small graph, whole under
    ``pieces=1``: no piece makes the new value of more than that share of the state's bytes (or of its largest
    array, where that is more), and the pieces compute the whole graph; the cuts follow
    the graph's values, not its nodes' layer tags (here also with every optimizer node tagged as one layer)."""
    from bridge.contract import LAYER, PHASE, Phase
    from bridge.tools.pieces import STATE_SHARE_PER_PIECE, split

    layers = 10  # equal layers: each weight's state is a tenth of the whole, under the share, two are over it
    case = replace(CASES["mlp-symbolic-batch"], dynamic=False, build=lambda: torch.nn.Sequential(
        torch.nn.Linear(6, 16), *(module for _ in range(layers) for module in (torch.nn.Tanh(), torch.nn.Linear(16, 16))),
        torch.nn.Linear(16, 3)), shape=(4, 6), sizes=(4,))
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim="adam")
    if layer_tags == "all one layer":
        for node in tm.model.graph.node:
            tags = {prop.key: prop for prop in node.metadata_props}
            if tags.get(PHASE) is not None and tags[PHASE].value == Phase.OPTIMIZER and LAYER in tags:
                tags[LAYER].value = "step"
    state = tm.initial_state()
    outputs = {value.name for value in tm.model.graph.output}
    updated = {f"updated_{name}": name for name in state if f"updated_{name}" in outputs}
    state_bytes = sum(value.nbytes for value in state.values())
    pieces = split(tm.model, 1, state_share=STATE_SHARE_PER_PIECE)
    replaced = [[updated[name] for name in piece.outputs if name in updated] for piece in pieces]
    assert sorted(name for names in replaced for name in names) == sorted(updated.values())
    bound = max(STATE_SHARE_PER_PIECE * state_bytes, max(state[name].nbytes for name in updated.values()))
    for names in replaced:
        assert sum(state[name].nbytes for name in names) <= bound, names
    _assert_pieces_compute_the_whole_graph(tm, pieces, case)


def test_in_place_pieces_release_a_dominant_old_state_array_before_making_its_update():
    """An Adam step whose one Linear holds most of the state, in in_place's pieces: the old second moment of that
    weight, which the optimizer reads (scaled by beta2) before it makes the new one, is last read by a piece
    before the one that makes its update, so the session releases it first and the update takes its memory
    instead of adding to it; the pieces compute the whole graph."""
    from bridge.contract import slot_name
    from bridge.tools.pieces import STATE_SHARE_PER_PIECE, split

    case = replace(CASES["mlp-symbolic-batch"], dynamic=False, build=lambda: torch.nn.Sequential(
        torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)), shape=(4, 6), sizes=(4,))
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim="adam")
    state = tm.initial_state()
    weight = max(tm.signature.weights, key=lambda name: state[name].nbytes)
    assert state[weight].nbytes > STATE_SHARE_PER_PIECE * sum(value.nbytes for value in state.values())
    second_moment = slot_name(weight, "exp_avg_sq")
    pieces = split(tm.model, 1, state_share=STATE_SHARE_PER_PIECE)
    last_read = max(index for index, piece in enumerate(pieces) if second_moment in piece.inputs)
    made = next(index for index, piece in enumerate(pieces) if f"updated_{second_moment}" in piece.outputs)
    assert last_read < made
    _assert_pieces_compute_the_whole_graph(tm, pieces, case)


@needs_onnx_mlir
def test_in_place_step_holds_no_array_past_the_piece_that_last_reads_it():
    """During an in_place step, when a piece starts, no old state array that an earlier piece last read and no
    value passed between pieces that an earlier piece last read is alive anywhere in the process (weak
    references to them are dead): each is freed as soon as its last reader has run."""
    import gc
    import weakref
    from types import SimpleNamespace

    case = CASES["mlp-symbolic-batch"]
    torch.manual_seed(0)
    tm = bridge.to_training_onnx(_export(case.build(), case.shape, case.dynamic), loss="ce", optim=case.optim,
                                 optim_options=case.options, dynamic_batch=case.dynamic, **case.convert)
    session = bridge.compile(tm, backend="onnx-mlir", in_place=True).session(seed=0)
    batch = _batches(session, case)[0]
    session.step(*batch)  # from here the session's state is the library's own output arrays
    last_reader = {name: index for index, piece in enumerate(session._pieces) for name in piece.input_names}
    watched = {name: weakref.ref(session.state[name]) for name in session.in_place}
    alive_too_long: list[tuple[int, str]] = []

    for index, piece in enumerate(session._pieces):
        inner = piece.session

        def run_piece(arrays: list[np.ndarray], index: int = index, inner=inner, names=piece.output_names) -> list:
            gc.collect()
            alive_too_long.extend((index, name) for name, ref in watched.items()
                                  if last_reader.get(name, len(session._pieces)) < index and ref() is not None)
            results = inner.run(arrays)
            watched.update({name: weakref.ref(value) for name, value in zip(names, results, strict=True)
                            if name not in session.output_names})
            return results

        session._pieces[index] = SimpleNamespace(**{**vars(piece), "session": SimpleNamespace(run=run_piece)})
    assert len(session._pieces) > 1 and any(session._step.state_released[:-1])
    session.step(*batch)
    assert not alive_too_long


@pytest.mark.parametrize("pieces", [0, -1, 2.5, "some", True])
def test_pieces_must_be_a_count_or_auto(pieces):
    _, model = small_mlp()
    with pytest.raises(bridge.InvalidOptionError, match=r"pieces=.* is not valid"):
        bridge.compile(model, backend="onnx-mlir", pieces=pieces)


@needs_onnx_mlir
def test_lr_is_live_and_noise_is_drawn(compiled):
    """lr=0 leaves every weight as it was; without given noise the session draws it (the step runs)."""
    session = compiled.compiled.session(seed=0)
    session.lr = 0.0
    before = {w: session.state[w].copy() for w in compiled.tm.weights}
    inputs, target = _batches(session, compiled.case)[0]
    session.step({"x": inputs["x"]}, target)
    for w in compiled.tm.weights:
        np.testing.assert_array_equal(session.state[w], before[w], err_msg=w)


@needs_onnx_mlir
def test_trainer_on_onnx_mlir_trains_like_onnxruntime_and_resumes_there(tmp_path):
    """Trainer(backend="onnx-mlir") steps like the onnxruntime Trainer; a checkpoint it writes resumes on
    onnxruntime (state is plain arrays, one graph hash) and continues as onnx-mlir does."""
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.05})
    data = features(12, seed=1)
    options = {"schedule": "step", "schedule_options": {"step_size": 1, "gamma": 0.5}, "seed": 3}
    om = bridge.Trainer(tm, backend="onnx-mlir", **options)
    assert isinstance(om.session, OnnxMlirTrainingSession)
    om.fit(data, epochs=1, batch_size=4)
    path = om.save_checkpoint(tmp_path / "om.npz")
    om.fit(data, epochs=1, batch_size=4)

    ort = bridge.Trainer(tm, threads=1, **options)
    ort.fit(data, epochs=2, batch_size=4)
    assert_steps_match([{"loss": s["loss"]} for s in om.history.steps], [{"loss": s["loss"]} for s in ort.history.steps],
                       rtol=TOLERANCE)
    assert [s["lr"] for s in om.history.steps] == [s["lr"] for s in ort.history.steps]

    resumed = bridge.Trainer(tm, threads=1, **options)
    resumed.load_checkpoint(path)
    assert resumed.epoch == 1
    resumed.fit(data, epochs=1, batch_size=4)
    assert_steps_match([om.state()], [resumed.state()], rtol=TOLERANCE)
    assert isinstance(om.session.eval_graph.graph, OnnxMlirGraph)  # the eval graph compiled too
    assert om.evaluate(data) == pytest.approx(resumed.evaluate(data), rel=TOLERANCE)


@needs_onnx_mlir
def test_training_model_session_on_onnx_mlir():
    """tm.session(backend="onnx-mlir", gradients=False): compiled without grad_*, steps as onnxruntime's; its eval
    graph is compiled too and evaluates as onnxruntime's."""
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adamw", optim_options={"lr": 0.05})
    session = tm.session(backend="onnx-mlir", gradients=False, seed=0)
    assert isinstance(session, OnnxMlirTrainingSession) and not any(n.startswith("grad_") for n in session.output_names)
    ort = tm.session(threads=1, gradients=False, seed=0)
    x, y = features(6, seed=4)
    assert_steps_match([session.step({"x": x}, y) for _ in range(2)], [ort.step({"x": x}, y) for _ in range(2)],
                       rtol=TOLERANCE)
    assert isinstance(session.eval_graph.graph, OnnxMlirGraph)
    assert_steps_match([session.evaluate({"x": x}, y)], [ort.evaluate({"x": x}, y)], rtol=TOLERANCE)


@needs_onnx_mlir
def test_accumulation_runs_the_compiled_halves():
    """With accumulation_steps, the gradient and update graphs run compiled by onnx-mlir (two more
    libraries in the process), and train as onnxruntime's accumulation does."""
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.05})
    data = features(16, seed=2)
    om = bridge.Trainer(tm, backend="onnx-mlir", accumulation_steps=2, seed=1)
    split = om.session.split_step
    assert isinstance(split.gradient, OnnxMlirGraph) and isinstance(split.update, OnnxMlirGraph)
    om.fit(data, epochs=1, batch_size=4)
    ort = bridge.Trainer(tm, accumulation_steps=2, seed=1, threads=1)
    ort.fit(data, epochs=1, batch_size=4)
    assert_steps_match([{"loss": s["loss"]} for s in om.history.steps], [{"loss": s["loss"]} for s in ort.history.steps],
                       rtol=TOLERANCE)
    assert_steps_match([om.state()], [ort.state()], rtol=TOLERANCE)


# a child process that loads the libraries given, in order, and steps the last once (onnx-mlir's reports go to
# the C library's stdout, which only a child's captured output holds whole)
_STEP_THE_LAST = """
import sys, numpy as np, onnx
from bridge.training.runtime_onnx_mlir import OnnxMlirTrainingSession
model, state = onnx.load(sys.argv[1]), dict(np.load(sys.argv[2]))
sessions = [OnnxMlirTrainingSession(path, state, training_model=model) for path in sys.argv[3:]]
rng = np.random.default_rng(0)
sessions[-1].step({"x": rng.standard_normal((6, 6)).astype(np.float32)}, rng.integers(0, 2, 6))
"""


@pytest.mark.parametrize("backend, spelling", [("iree", "native"), pytest.param("onnx-mlir", "host", marks=needs_onnx_mlir)])
def test_this_machines_cpu_is_host_or_native_for_either_backend(backend, spelling):
    """IREE names the CPU it runs on ``host``, onnx-mlir ``native``, and each aborts on the other's name;
    ``bridge.compile`` takes either for either backend: the module runs, and its steps match onnxruntime's."""
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="sgd")
    session = bridge.compile(tm, backend=backend, target_cpu=spelling).session()
    reference = bridge.TrainingSession(tm.model, tm.initial_state())
    batches = [features(8, seed) for seed in range(2)]
    assert_steps_match([session.step({"x": x}, y) for x, y in batches], [reference.step({"x": x}, y) for x, y in batches])


@needs_onnx_mlir
def test_one_graph_compiled_with_other_flags_runs_its_own_code(tmp_path):
    """Two libraries of one graph, compiled with different flags, loaded in one process: the one loaded second
    runs its own code (its instrumentation reports each Gemm's signature), not the first one's."""
    _, model = small_mlp()
    tm = bridge.to_training_onnx(model, loss="ce", optim="sgd")
    tm.save(tmp_path / "train.onnx")
    np.savez(tmp_path / "state.npz", **tm.initial_state())
    plain, reporting = tmp_path / "plain.so", tmp_path / "reporting.so"
    bridge.compile(tm, backend="onnx-mlir", output=plain)
    bridge.compile(tm, backend="onnx-mlir", output=reporting, extra_args=("--instrument-stage=Onnx", "--instrument-signature=onnx.Gemm"))
    done = subprocess.run([sys.executable, "-c", _STEP_THE_LAST, str(tmp_path / "train.onnx"), str(tmp_path / "state.npz"),
                           str(plain), str(reporting)], capture_output=True, text=True, check=True)
    assert done.stdout.count("==SIG-REPORT==, onnx.Gemm") >= 2, done.stdout[-500:]


@needs_onnx_mlir
def test_outputs_that_are_views_of_one_value_run_and_release():
    """Outputs that are views of one value (Identity, Reshape, Unsqueeze, Cast, Mul by 1, Add of 0), which
    onnx-mlir would return as one buffer each and abort releasing: each has the first output's values and
    the process survives releasing them (a child process: an abort would end this one)."""
    from repros.onnx_mlir_aliased_outputs import FORMS, build, compile_and_run

    result = compile_and_run(build(*FORMS))
    assert result.returncode == 0 and "released" in result.stdout, result.stderr[-300:]
    differences = re.search(r"differ \[(.*)\]", result.stdout).group(1).split(", ")
    assert differences == ["0.0"] * len(FORMS), result.stdout


_STEADY_STATE_FAULTS = """
import resource, sys, numpy as np, onnx
from bridge.training.runtime_onnx_mlir import OnnxMlirGraph
graph = OnnxMlirGraph(open(sys.argv[1], "rb").read(), onnx.load(sys.argv[2]))
rng = np.random.default_rng(0)
feed = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in onnx.load(sys.argv[2]).graph.input}
for _ in range(3):
    graph(feed)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    graph(feed)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


@needs_onnx_mlir
def test_steps_reuse_their_buffers_unless_the_environment_tunes_malloc(tmp_path):
    """A Conv's im2col columns (nine 256 KiB slices and their 2.3 MiB concatenation, made and freed in each
    call) come from the memory the previous call freed: after warm-up a call page-faults almost none of
    those pages (glibc's defaults would map, unmap and re-fault them every call). With a malloc setting in
    the environment (benchmarks/step_memory.py's), that setting holds: every call faults the columns in.
    Child processes, so that no earlier session's setting counts."""
    import os

    from repros.compiled_conv_im2col import im2col_graph

    model = im2col_graph()
    onnx.save(model, tmp_path / "im2col.onnx")
    bridge.compile(model, backend="onnx-mlir", output=tmp_path / "im2col.so")
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    faults = {}
    for case, extra in (("kept", {}), ("mapped", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        done = subprocess.run([sys.executable, "-c", _STEADY_STATE_FAULTS, str(tmp_path / "im2col.so"),
                               str(tmp_path / "im2col.onnx")], capture_output=True, text=True, check=True,
                              env={**environment, **extra})
        faults[case] = float(done.stdout.split()[-1])
    column_pages = 9 * 256 * 1024 // 4096
    assert faults["kept"] < column_pages / 10 <= column_pages <= faults["mapped"], faults


def _broadcast_mismatch() -> onnx.ModelProto:
    """A Mul of a [2, 3] by a [3, 2] tensor: no broadcast exists, which onnx-mlir's shape inference reports."""
    weight = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["m"], name="head/scale/Mul"),
             helper.make_node("Relu", ["m"], ["y"], name="head/act/Relu")]
    graph = helper.make_graph(nodes, "broadcast_mismatch", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@needs_onnx_mlir
@pytest.mark.parametrize("pieces", [1, 2])
def test_compile_error_names_the_offending_node(pieces):
    """Whole or in pieces (where the cut finds the value untyped), the error names the node."""
    with pytest.raises(bridge.CompileError, match=r"(?s)onnx-mlir could not compile.*node 'head/scale/Mul' \(Mul\)") as error:
        bridge.compile(_broadcast_mismatch(), backend="onnx-mlir", pieces=pieces)
    assert {d[:2] for d in error.value.diagnostics} == {("head/scale/Mul", "Mul")}


@needs_onnx_mlir
@pytest.mark.parametrize("pieces", ["auto", "2"])
def test_cli_compile_reports_phases_and_writes_a_library(pieces, tmp_path, capsys):
    torch.manual_seed(0)
    source = tmp_path / "mlp.onnx"
    onnx.save(_export(_mlp(), (4, 6), dynamic=False), str(source))
    train = tmp_path / "train.onnx"
    assert cli_main(["convert", str(source), "-o", str(train), "--loss", "ce", "--optim", "sgd"]) == 0
    capsys.readouterr()
    assert cli_main(["compile", str(train), "--backend", "onnx-mlir", "-o", str(tmp_path / "train.so"), "--pieces", pieces]) == 0
    err = capsys.readouterr().err
    for phase in (r"onnx-mlir \[1/6\] Importing ONNX Model", r"onnx-mlir \[5/6\] Linking", r"onnx-mlir: done \(\d+\.\d s"):
        assert re.search(phase, err), (phase, err)
    state = dict(np.load(tmp_path / "train.state.npz"))
    session = OnnxMlirTrainingSession(tmp_path / "train.so", state, training_model=onnx.load(str(train)))
    ort = bridge.TrainingSession(str(train), state, threads=1)
    rng = np.random.default_rng(0)
    inputs, target = {"x": rng.standard_normal((4, 6)).astype(np.float32)}, rng.integers(0, 3, 4).astype(np.int64)
    assert_steps_match([session.step(inputs, target)], [ort.step(inputs, target)], rtol=TOLERANCE)


def test_missing_onnx_mlir_names_what_to_install(tmp_path, monkeypatch, capsys):
    """ONNX_MLIR_HOME pointing at an empty folder: one error naming the missing files and the packages."""
    monkeypatch.setenv("ONNX_MLIR_HOME", str(tmp_path))
    _, model = small_mlp()
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    with pytest.raises(OnnxMlirNotFoundError, match=r"bin/onnx-mlir.*libllvm22 libprotobuf32 llvm-22 clang-22") as error:
        bridge.compile(path, backend="onnx-mlir")
    assert isinstance(error.value, bridge.BridgeError)
    with pytest.raises(OnnxMlirNotFoundError, match="ONNX_MLIR_HOME"):
        OnnxMlirTrainingSession(b"", {})
    assert cli_main(["compile", str(path), "--backend", "onnx-mlir", "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "bridge: error: onnx-mlir" in err and "docker" in err, err


@needs_onnx_mlir
def test_a_file_that_is_not_a_library_is_refused(tmp_path):
    (tmp_path / "junk.so").write_bytes(b"not a library")
    with pytest.raises(bridge.ModelLoadError, match="junk.so"):
        OnnxMlirTrainingSession(tmp_path / "junk.so", {})


@needs_onnx_mlir
def test_a_compile_past_its_timeout_is_stopped(tmp_path, capsys):
    _, model = small_mlp()
    size = rf"compiling graph '{model.graph.name}' \({len(model.graph.node)} ONNX nodes"
    with pytest.raises(bridge.CompileError, match=rf"onnx-mlir ran past the timeout of 0.01 s {size}"):
        bridge.compile(model, backend="onnx-mlir", timeout=0.01)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    assert cli_main(["compile", str(path), "--backend", "onnx-mlir", "-o", str(tmp_path / "m.so"), "--timeout", "0.01"]) == 2
    assert "ran past the timeout of 0.01 s" in capsys.readouterr().err and not (tmp_path / "m.so").exists()
    with pytest.raises(bridge.InvalidOptionError, match="timeout=0"):
        bridge.compile(model, backend="onnx-mlir", timeout=0)


def test_a_timeout_also_stops_what_onnx_mlir_started(tmp_path, monkeypatch):
    """A stand-in onnx-mlir that reports its first phase, then waits on a child process that holds its output
    (as onnx-mlir waits on opt, llc and clang++): the timeout stops both, it does not wait for the child."""
    home = tmp_path / "onnx-mlir"
    (home / "bin").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "lib" / "PyRuntime.py").write_text("")
    compiler = home / "bin" / "onnx-mlir"
    compiler.write_text('#!/bin/sh\necho "[1/6] Wed Dec  2 10:00:00 2026 (0s) Importing ONNX Model to MLIR Module"\n'
                        "sleep 120 &\nwait\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("ONNX_MLIR_HOME", str(home))
    try:
        find_onnx_mlir()
    except OnnxMlirNotFoundError as exc:  # the LLVM tools onnx-mlir calls are checked too
        pytest.skip(str(exc))
    start = time.perf_counter()
    with pytest.raises(bridge.CompileError, match=r"ran past the timeout of 1 s .*last phase: \[1/6\] Importing ONNX Model"):
        bridge.compile(small_mlp()[1], backend="onnx-mlir", timeout=1)
    assert time.perf_counter() - start < 60, "the compile waited for the child process"


@needs_onnx_mlir
def test_casts_the_check_allows_compile_and_equal_onnxruntime(tmp_path):
    """Every cast between two types of ``CAST_TYPES`` that ``bridge check --target onnx-mlir`` lets through
    compiles and gives onnxruntime's values; one it refuses (int64 to uint8) fails to compile."""
    import itertools

    import onnxruntime
    from repros.onnx_mlir_defects import compile_as_is

    from bridge.tools.target_check import CAST_TYPES, check

    def casts(pairs):
        nodes = [helper.make_node("Cast", [f"x{i}"], [f"y{i}"], name=f"cast{i}", to=to) for i, (_, to) in enumerate(pairs)]
        inputs = [helper.make_tensor_value_info(f"x{i}", source, [32]) for i, (source, _) in enumerate(pairs)]
        outputs = [helper.make_tensor_value_info(f"y{i}", to, [32]) for i, (_, to) in enumerate(pairs)]
        return helper.make_model(helper.make_graph(nodes, "casts", inputs, outputs), opset_imports=[helper.make_opsetid("", 18)])

    every = list(itertools.permutations(sorted(CAST_TYPES), 2))
    refused = {int(v.node.removeprefix("cast")) for v in check(casts(every), "onnx-mlir", compile=False)}
    allowed = [pair for i, pair in enumerate(every) if i not in refused]
    assert (TensorProto.INT64, TensorProto.UINT8) not in allowed and (TensorProto.INT64, TensorProto.FLOAT) in allowed
    rng = np.random.default_rng(0)
    feeds = {}
    for index, (source, _) in enumerate(allowed):
        values = rng.uniform(0, 100, 32)  # within every type's range (ONNX leaves out-of-range casts undefined)
        feeds[f"x{index}"] = (values > 50) if source == TensorProto.BOOL else values.astype(helper.tensor_dtype_to_np_dtype(source))
    model = casts(allowed)
    got = OnnxMlirGraph(open(compile_as_is(model, str(tmp_path)), "rb").read(), model)(feeds)
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for index, (source, to) in enumerate(allowed):
        name = f"{TensorProto.DataType.Name(source)} -> {TensorProto.DataType.Name(to)}"
        assert got[f"y{index}"].dtype == want[index].dtype and np.array_equal(got[f"y{index}"], want[index]), name
    with pytest.raises(subprocess.CalledProcessError):
        compile_as_is(casts([(TensorProto.INT64, TensorProto.UINT8)]), str(tmp_path))
