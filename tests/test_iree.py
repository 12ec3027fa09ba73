"""Training graphs compiled by an MLIR compiler (IREE, llvm-cpu) train like onnxruntime.

Each model family's training graph is compiled once per module, run for 3 steps with the
state fed back, and every output (loss, grad_*, updated_*) is compared with the same steps in
onnxruntime (which tests/test_*.py compare with PyTorch).
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
import torch
from helpers.reference import assert_steps_match, steps_with_state_edits
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.cli import main as cli_main
from bridge.contract import UPDATED_PREFIX, updated_name
from bridge.errors import MissingExtraError
from bridge.training.runtime_iree import IreeTrainingSession

pytestmark = pytest.mark.iree


@dataclass
class Family:
    """A small torch model of one family (exported with a symbolic batch) and how it is trained."""

    build: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]
    loss: str = "ce"
    optim: str = "adam"
    optim_options: dict = field(default_factory=lambda: {"lr": 0.05})
    classes: int | None = 3
    train_export: bool = False  # export in training mode (keeps Dropout)
    convert: dict = field(default_factory=dict)  # more to_training_onnx arguments


class _Recurrent(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(4, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class _Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _mlp_dropout():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 3))


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 6, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(6, 3),
    )


def _cnn_strided():
    return torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, stride=2), torch.nn.Flatten(), torch.nn.Linear(6, 3))


MOMENTUM = {"lr": 0.05, "momentum": 0.9}
FAMILIES = {
    "mlp": Family(_mlp, (2, 6)),
    "mlp_sgd_mse": Family(_mlp, (2, 6), loss="mse", optim="sgd", optim_options=MOMENTUM, classes=None),
    "mlp_dropout": Family(_mlp_dropout, (2, 6), train_export=True),
    "cnn": Family(_cnn, (2, 3, 8, 8)),
    "cnn_frozen_batch_norm": Family(_cnn, (2, 3, 8, 8), convert={"batch_norm": "frozen"}),
    # A strided Conv whose windows leave input unread (IREE could not compile it; see nn.py).
    "cnn_strided": Family(_cnn_strided, (2, 4, 4, 4), optim="sgd", optim_options=MOMENTUM),
    # SGD: the attention key bias has an exactly-zero gradient, which Adam turns into noise/|noise|.
    "transformer": Family(_Transformer, (2, 5, 16), optim="sgd", optim_options=MOMENTUM),
    "lstm": Family(lambda: _Recurrent("LSTM"), (2, 5, 4)),
    "gru": Family(lambda: _Recurrent("GRU"), (2, 5, 4)),
}
FAST = {"mlp", "mlp_sgd_mse", "mlp_dropout"}
# Batch modes: to_training_onnx options and the batch size of each of the 3 steps.
BATCH_MODES = {
    "static": ({"dynamic_batch": False, "batch_size": 2}, (2, 2, 2)),
    "dynamic": ({"dynamic_batch": True}, (3, 1, 4)),
}


def _params():
    for family in FAMILIES:
        for mode in BATCH_MODES:
            marks = [] if family in FAST else [pytest.mark.slow]
            yield pytest.param((family, mode), marks=marks, id=f"{family}-{mode}")


@dataclass
class Compiled:
    tm: bridge.TrainingModel
    compiled: bridge.CompiledModel
    batches: list


def _batches(family: Family, tm: bridge.TrainingModel, sizes: tuple[int, ...]) -> list:
    rng = np.random.default_rng(0)
    batches = []
    for size in sizes:
        inputs = {"x": rng.standard_normal((size, *family.input_shape[1:])).astype(np.float32)}
        target_shape = (size, *tm.target_shape[1:])
        if family.classes:
            target = rng.integers(0, family.classes, size=target_shape).astype(tm.target_dtype)
        else:
            target = rng.standard_normal(target_shape).astype(tm.target_dtype)
        batches.append((inputs, target))
    return batches


@pytest.fixture(scope="module", params=list(_params()))
def compiled(request, tmp_path_factory) -> Compiled:
    family_name, mode = request.param
    family = FAMILIES[family_name]
    options, sizes = BATCH_MODES[mode]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(family_name) / "model.onnx"
    module = family.build().train(family.train_export)
    training = torch.onnx.TrainingMode.TRAINING if family.train_export else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(module, (torch.randn(family.input_shape),), str(path), dynamo=False, training=training,
                      do_constant_folding=not family.train_export, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    tm = bridge.to_training_onnx(str(path), loss=family.loss, optim=family.optim,
                                 optim_options=family.optim_options, **options, **family.convert)
    return Compiled(tm, bridge.compile(tm), _batches(family, tm, sizes))


def test_compiled_steps_match_onnxruntime(compiled):
    iree = compiled.compiled.session(seed=0)
    ort = bridge.TrainingSession(compiled.tm.model, compiled.tm.initial_state(), seed=0)  # same Dropout noise
    got = [iree.step(inputs, target) for inputs, target in compiled.batches]
    want = [ort.step(inputs, target) for inputs, target in compiled.batches]
    assert set(got[0]) == set(want[0]) == {o.name for o in compiled.tm.model.graph.output}
    assert_steps_match(got, want)


def test_emitted_graph_avoids_known_iree_defects(compiled):
    """No ConvTranspose with asymmetric pads/output_shape, MaxPool Indices, Gelu(tanh), Dropout; onnx-mlir check clean."""
    for node in compiled.tm.model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        where = f"{node.name} ({node.op_type})"
        if node.op_type == "ConvTranspose":
            pads = list(attrs.get("pads", []))
            assert "output_shape" not in attrs and pads[: len(pads) // 2] == pads[len(pads) // 2:], where
        assert not (node.op_type == "MaxPool" and len([o for o in node.output if o]) > 1), where
        assert not (node.op_type == "Gelu" and attrs.get("approximate") == b"tanh"), where
        assert node.op_type != "Dropout", where
    assert bridge.check(compiled.tm.model, target="onnx-mlir", compile=False) == []


def test_lr_change_reaches_compiled_step(compiled):
    """The lr input is live: a session stepped at lr=0 leaves every weight unchanged."""
    session = compiled.compiled.session()
    session.lr = 0.0
    before = {w: session.state[w].copy() for w in compiled.tm.weights}
    session.step(*compiled.batches[0])
    for w in compiled.tm.weights:
        np.testing.assert_array_equal(session.state[w], before[w], err_msg=w)


def test_state_edits_between_steps_reach_compiled_step(compiled):
    """The state carried between steps is the state the next step reads: the edits of ``steps_with_state_edits``
    give the same next step as in onnxruntime."""
    iree = compiled.compiled.session(seed=0)
    ort = bridge.TrainingSession(compiled.tm.model, compiled.tm.initial_state(), seed=0)
    assert_steps_match(*[steps_with_state_edits(session, compiled.tm.weights, *compiled.batches[0]) for session in (iree, ort)])


def test_in_place_steps_are_bit_identical_and_reuse_the_state_buffers(compiled):
    """``in_place=True``: every step (3 batches, then state edits between steps) equals the step of the module
    that returns new buffers bit for bit; every state the step updates (the weights the backward reads among
    it) stays in the same memory from step to step; the arrays given as the initial state are not written."""
    in_place = bridge.compile(compiled.tm, in_place=True)
    initial = compiled.tm.initial_state()
    given = {name: value.copy() for name, value in initial.items()}
    sessions = [compiled.compiled.session(seed=0), in_place.session(initial, seed=0)]
    overwritten = sessions[1].in_place
    assert any(name.startswith(weight + ".") for name in overwritten for weight in compiled.tm.weights)
    steps = [[{name: value.copy() for name, value in session.step(inputs, target).items()}
              for inputs, target in compiled.batches] for session in sessions]
    assert {name for name in steps[0][0] if name.startswith(UPDATED_PREFIX)} == {updated_name(name) for name in overwritten}
    before = {name: sessions[1].state[name] for name in overwritten}
    steps = [runs + steps_with_state_edits(session, compiled.tm.weights, *compiled.batches[0])
             for runs, session in zip(steps, sessions, strict=True)]
    for untied, tied in zip(*steps, strict=True):
        assert set(untied) == set(tied)
        for name in untied:
            np.testing.assert_array_equal(tied[name], untied[name], err_msg=name)
    for name in overwritten:
        if not name.startswith(sorted(compiled.tm.weights)[1]):  # steps_with_state_edits replaces that one
            assert np.shares_memory(sessions[1].state[name], before[name]), name
    for name, value in given.items():
        np.testing.assert_array_equal(initial[name], value, err_msg=name)


def test_the_outputs_a_step_returns_keep_none_of_its_gradients_alive(tmp_path):
    """``in_place=True`` runs the step in two calls, the first returning the gradients together with the loss:
    while the caller holds the outputs of a step that returns no gradients (``bridge.Trainer``'s: the loss, and
    the state, which lives in its own buffers anyway), IREE holds the state's buffers and not the gradients.
    ``local-sync``: every buffer comes from the device allocator, whose statistics count the bytes it holds."""
    import iree.runtime as rt

    allocator = rt.get_device("local-sync").allocator
    if not allocator.has_statistics:
        pytest.skip("this IREE runtime keeps no allocator statistics")
    torch.manual_seed(0)
    source = tmp_path / "wide.onnx"
    wide = torch.nn.Sequential(torch.nn.Linear(6, 512), torch.nn.Tanh(), torch.nn.Linear(512, 3))
    torch.onnx.export(wide.eval(), (torch.randn(2, 6),), str(source), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(source), loss="ce", optim="adam")
    state = tm.initial_state()
    session = IreeTrainingSession(bridge.compile(tm, gradients=False, in_place=True), state, driver="local-sync", training_model=tm.model)

    def held() -> int:
        figures = allocator.statistics
        return figures["device_bytes_allocated"] - figures["device_bytes_freed"]

    before = held()
    inputs, target = {"x": np.ones((2, 6), np.float32)}, np.zeros(tm.target_shape, tm.target_dtype)
    outputs = [session.step(inputs, target) for _ in range(2)]
    weight_bytes = sum(state[name].nbytes for name in tm.weights)
    assert held() - before < sum(value.nbytes for value in state.values()) + weight_bytes / 2
    assert all(np.isfinite(output["loss"]) for output in outputs)


def test_in_place_refuses_what_it_cannot_keep(tmp_path):
    """An in-place module cannot restore the state after a non-finite step: ``on_nonfinite="skip"`` is refused
    and the ``"raise"`` error says the state holds the step; ``in_place`` is a bool."""
    torch.manual_seed(0)
    source = tmp_path / "mlp.onnx"
    torch.onnx.export(_mlp().eval(), (torch.randn(2, 6),), str(source), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(source), loss="ce", optim="adam")
    with pytest.raises(bridge.InvalidOptionError, match="in_place='yes'"):
        bridge.compile(tm, in_place="yes")
    module = bridge.compile(tm, in_place=True)
    with pytest.raises(bridge.InvalidOptionError, match="on_nonfinite='skip'"):
        module.session(on_nonfinite="skip")
    session = module.session()
    session.lr = np.inf
    inputs = {"x": np.ones((2, 6), np.float32)}
    with pytest.raises(bridge.NonFiniteError, match="in place"):
        session.step(inputs, np.zeros(tm.target_shape, tm.target_dtype))


def test_cli_compile_and_mlir_make_a_self_describing_module(tmp_path):
    torch.manual_seed(0)
    source = tmp_path / "mlp.onnx"
    torch.onnx.export(_mlp().eval(), (torch.randn(5, 6),), str(source), dynamo=False, input_names=["x"], output_names=["y"])
    train = tmp_path / "train.onnx"
    assert cli_main(["convert", str(source), "-o", str(train), "--loss", "ce", "--optim", "rmsprop"]) == 0
    assert cli_main(["compile", str(train), "--backend", "iree", "-o", str(tmp_path / "train.vmfb")]) == 0
    assert cli_main(["mlir", str(train), "-o", str(tmp_path / "train.mlir")]) == 0
    text = (tmp_path / "train.mlir").read_text()
    assert 'torch.operator "onnx.Gemm"' in text or 'torch.operator "onnx.MatMul"' in text
    assert 'loc("' in text, "ONNX node names are the MLIR locations"

    # --no-gradients: a module without the grad_* outputs (what bridge.Trainer compiles), the same step
    assert cli_main(["compile", str(train), "-o", str(tmp_path / "lean.vmfb"), "--no-gradients"]) == 0
    whole = onnx.load(str(train))
    bridge.compile(whole, gradients=False)
    assert any(o.name.startswith("grad_") for o in whole.graph.output)  # the caller's model keeps them

    state = dict(np.load(tmp_path / "train.state.npz"))
    iree = IreeTrainingSession(tmp_path / "train.vmfb", state)
    lean = IreeTrainingSession(tmp_path / "lean.vmfb", state)
    ort = bridge.TrainingSession(str(train), state)
    model = onnx.load(str(train))
    assert iree.input_names == lean.input_names == [i.name for i in model.graph.input]
    assert iree.output_names == [o.name for o in model.graph.output]
    assert lean.output_names == [o.name for o in model.graph.output if not o.name.startswith("grad_")]
    assert len(lean.output_names) < len(iree.output_names)
    rng = np.random.default_rng(0)
    for _ in range(3):
        inputs = {"x": rng.standard_normal((5, 6)).astype(np.float32)}
        target = rng.integers(0, 3, size=5).astype(np.int64)
        want = ort.step(inputs, target)
        assert_steps_match([iree.step(inputs, target)], [want])
        assert_steps_match([lean.step(inputs, target)], [{k: v for k, v in want.items() if k in lean.output_names}])


def _convtranspose_output_shape() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "W")
    node = helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="decoder/up/ConvTranspose",
                            strides=[2, 2], output_shape=[8, 8])
    graph = helper.make_graph([node], "convtranspose_output_shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_compile_error_names_the_offending_node():
    with pytest.raises(bridge.CompileError, match=r"node 'decoder/up/ConvTranspose' \(ConvTranspose\)") as error:
        bridge.compile(_convtranspose_output_shape())
    assert [d[:2] for d in error.value.diagnostics] == [("decoder/up/ConvTranspose", "ConvTranspose")]


def test_bad_arguments_raise_bridge_errors(tmp_path):
    with pytest.raises(bridge.InvalidOptionError, match="backend='tvm'"):
        bridge.compile(tmp_path / "missing.onnx", backend="tvm")
    with pytest.raises(bridge.ModelLoadError, match="missing.onnx"):
        bridge.compile(tmp_path / "missing.onnx")
    with pytest.raises(bridge.InvalidOptionError, match="gradients='no'"):
        bridge.compile(tmp_path / "missing.onnx", gradients="no")
    (tmp_path / "junk.vmfb").write_bytes(b"not a module")
    with pytest.raises(bridge.ModelLoadError, match="IREE module"):
        IreeTrainingSession(tmp_path / "junk.vmfb", {})


def test_check_target_iree_flags_the_known_pattern_and_compiles_the_rest():
    """A known IREE pattern is flagged without compiling; other graphs are compiled, and the
    compiler's errors become violations of the node they name."""
    from repros.iree_conv_unread_pad import build

    flagged = bridge.check(build(), target="iree")
    assert [(v.node, v.op) for v in flagged] == [("strided_conv", "Conv")] * 2  # both spatial axes
    assert "1-wide output" in flagged[0].problem
    assert bridge.check(build(end_pad=0), target="iree") == []
    compiled = bridge.check(_convtranspose_output_shape(), target="iree")
    assert [(v.node, v.op) for v in compiled] == [("decoder/up/ConvTranspose", "ConvTranspose")]
    assert compiled[0].problem.startswith("IREE: ")


def test_cli_compile_reports_phases_and_check_iree(tmp_path, capsys):
    from repros.iree_conv_unread_pad import build

    path = tmp_path / "conv.onnx"
    onnx.save(build(end_pad=0), str(path))
    assert cli_main(["compile", str(path), "-o", str(tmp_path / "conv.vmfb")]) == 0
    err = capsys.readouterr().err
    for phase in (r"import: 1 ONNX nodes", r"import: done \(\d+\.\d s\)", r"compile: iree-compile",
                  r"compile: done \(\d+\.\d s in all\)"):
        assert re.search(phase, err), (phase, err)
    onnx.save(build(), str(path))
    assert cli_main(["check", str(path), "--target", "iree"]) == 1
    assert "strided_conv (Conv)" in capsys.readouterr().out


def test_missing_iree_names_the_install_extra(monkeypatch, capsys, tmp_path):
    from repros.iree_conv_unread_pad import build

    monkeypatch.setitem(sys.modules, "iree.compiler", None)  # import iree.compiler -> ImportError
    monkeypatch.setitem(sys.modules, "iree.runtime", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'bridge\[iree\]'"):
        bridge.compile(build())
    with pytest.raises(MissingExtraError, match=r"bridge\[iree\]"):
        IreeTrainingSession(b"", {})
    path = tmp_path / "conv.onnx"
    onnx.save(build(end_pad=0), str(path))
    assert cli_main(["check", str(path), "--target", "iree"]) == 0  # the patterns, no compile
    assert "bridge[iree]" in capsys.readouterr().err
    assert cli_main(["compile", str(path), "-o", str(tmp_path / "conv.vmfb")]) == 2
    assert "bridge[iree]" in capsys.readouterr().err
