"""``bridge.verify`` / ``bridge verify``: passes on correct training graphs (an MLP, a CNN with
BatchNorm and Dropout, zoo models), fails naming the tensor on deliberately broken ones."""
from __future__ import annotations

import dataclasses
import importlib
import io
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from test_zoo_text import MATRIX as TEXT_MATRIX
from test_zoo_vision import MATRIX as VISION_MATRIX
from zoo.exporters import export
from zoo.handbuilt import CASES, bigru_regressor, layernorm_gelu, lstm_classifier
from zoo.torch_models import TEXT, VISION

import bridge
from bridge.cli import main
from bridge.pipeline.annotate import PHASE
from bridge.pipeline.importer.registry import CONVERTERS, import_all_converters

MLP = str(Path(__file__).resolve().parent.parent / "examples" / "models" / "mlp.onnx")
verify_module = importlib.import_module("bridge.tools.verify")


def _failed(report: bridge.VerifyReport) -> set[str]:
    return {row.name for row in report.failures}


@pytest.mark.parametrize("loss, optim", [("ce", "adam"), ("mse", "sgd")])
def test_mlp_passes(loss, optim):
    report = bridge.verify(MLP, loss, optim)
    assert report.passed, str(report)
    names = {row.name for row in report.rows}
    assert {"loss", "grad_fc1.weight", "updated_fc2.bias", "updated_step", "fd grad_fc1.weight"} <= names
    assert {row.step for row in report.rows} == {1, 2, 3}
    assert str(report).splitlines()[-1].startswith("PASS")


def test_mlp_rows_cover_every_output_and_state_slot():
    tm = bridge.to_training_onnx(MLP, loss="ce", optim="adam")
    report = bridge.verify(MLP, "ce", "adam", steps=1)
    outputs = [o.name for o in tm.model.graph.output]
    assert [row.name for row in report.rows if not row.name.startswith(("fd ", "forward "))] == outputs
    assert {row.name for row in report.rows if row.name.startswith("fd ")} == {f"fd grad_{w}" for w in tm.weights}
    assert [row.name for row in report.rows if row.name.startswith("forward ")] == ["forward logits"]  # the source's output


def test_conversion_options_apply_to_both_sides():
    """Clipping (the reference calls clip_grad_norm_), a trained subset and a batch size for the
    symbolic batch dim: with a tiny max norm an unclipped reference would fail every update."""
    report = bridge.verify(MLP, "ce", "sgd", optim_options={"lr": 0.1, "momentum": 0.9}, clip_grad_norm=0.01,
                           trainable=["fc1.*"], batch_size=5, steps=2, fd_max=0)
    assert report.passed, str(report)
    assert {row.name for row in report.rows if row.name.startswith("grad_")} == {"grad_fc1.weight", "grad_fc1.bias"}


def _cnn() -> onnx.ModelProto:
    """Conv -> BatchNorm -> ReLU -> MaxPool -> Dropout -> Linear, exported in training mode (Dropout kept)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.MaxPool2d(2), torch.nn.Dropout(0.25), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 4 * 4, 5))
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(3, 3, 8, 8),), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, input_names=["x"], output_names=["y"])
    return onnx.load_from_string(buffer.getvalue())


def test_cnn_with_batchnorm_and_dropout_passes():
    model = _cnn()
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam")
    assert len(tm.signature.random) == 1 and tm.signature.buffers  # Dropout noise and running statistics exist
    report = bridge.verify(model, "ce", "adam")
    assert report.passed, str(report)
    names = {row.name for row in report.rows}
    assert {f"updated_{b}" for b in tm.signature.buffers} <= names
    assert "forward y" in names  # a train-mode export: onnxruntime runs its Dropout as inference, as bridge's eval


def test_cnn_with_frozen_batchnorm_passes_and_leaves_the_model_as_given(tmp_path, capsys):
    """``batch_norm="frozen"`` (``--batch-norm frozen``, or a file ``export_for_training`` marks so) reaches the
    reference and the forward check (the source's BatchNorms in inference mode for onnxruntime), not only the
    conversion."""
    model = _cnn()
    before = model.SerializeToString()
    report = bridge.verify(model, "ce", "adam", steps=2, batch_norm="frozen")
    assert report.passed, str(report)
    assert "forward y" in {row.name for row in report.rows}
    assert model.SerializeToString() == before
    onnx.save(model, tmp_path / "cnn.onnx")
    assert main(["verify", str(tmp_path / "cnn.onnx"), "--steps", "1", "--batch-norm", "frozen"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS")
    model.metadata_props.add(key="bridge.batch_norm", value="frozen")
    report = bridge.verify(model, "ce", "adam", steps=2)
    assert report.passed, str(report)


def test_cnn_fails_when_the_reference_gets_other_dropout_noise(monkeypatch):
    """The CNN passes only because bridge and the reference get the same Dropout masks."""
    loss = verify_module._Reference._loss

    def other_noise(self, program, dtype, batch, tensors):
        noise = {k: np.random.default_rng(99).random(v.shape).astype(v.dtype) for k, v in batch.noise.items()}
        return loss(self, program, dtype, verify_module._Batch(batch.inputs, noise, batch.target), tensors)

    monkeypatch.setattr(verify_module._Reference, "_loss", other_noise)
    report = bridge.verify(_cnn(), "ce", "adam", steps=1)
    assert {"loss", "grad_6.weight"} <= _failed(report)


# --- deliberately broken training graphs ------------------------------------------------------

def _patch_conversion(monkeypatch, edit: Callable[[onnx.ModelProto], None]) -> None:
    """Make verify convert as usual, then ``edit`` the training graph it runs."""
    def convert(*args, **kwargs):
        tm = bridge.to_training_onnx(*args, **kwargs)
        edit(tm.model)
        return tm

    monkeypatch.setattr(verify_module, "to_training_onnx", convert)


def _scale_value(model: onnx.ModelProto, name: str, factor: float) -> None:
    """Multiply the value ``name`` by ``factor`` for every reader (graph output or node)."""
    raw = f"{name}.unscaled"
    for node in model.graph.node:
        node.output[:] = [raw if o == name else o for o in node.output]
        node.input[:] = [raw if i == name else i for i in node.input]
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(factor, np.float32), f"{name}.factor"))
    producer = next(i for i, n in enumerate(model.graph.node) if raw in n.output)
    model.graph.node.insert(producer + 1, helper.make_node("Mul", [raw, f"{name}.factor"], [name], name=f"{name}.broken"))
    for node in model.graph.node[producer + 2:]:
        node.input[:] = [name if i == raw else i for i in node.input]


def test_scaled_gradient_fails_naming_the_tensor(monkeypatch):
    _patch_conversion(monkeypatch, lambda model: _scale_value(model, "grad_fc2.bias", 1.01))
    report = bridge.verify(MLP, "ce", "sgd")
    assert not report.passed
    # SGD reads the wrong gradient: the update and, from step 2, everything downstream is off
    assert {"grad_fc2.bias", "updated_fc2.bias"} <= _failed(report)
    assert all(row.passed for row in report.rows if row.name.startswith("fd "))  # the reference is untouched
    assert "FAIL" in str(report).splitlines()[-1] and "grad_fc2.bias" in str(report).splitlines()[-1]


def _first_backward_mul(model: onnx.ModelProto) -> str:
    for node in model.graph.node:
        phase = {p.key: p.value for p in node.metadata_props}.get(PHASE)
        if node.op_type == "Mul" and phase == "backward":
            return node.output[0]
    raise AssertionError("no backward Mul")


def test_changed_backward_mul_fails(monkeypatch):
    def edit(model):
        _scale_value(model, _first_backward_mul(model), 1.001)

    _patch_conversion(monkeypatch, edit)
    report = bridge.verify(MLP, "ce", "adam", steps=1)
    failed = _failed(report)
    assert not report.passed and any(name.startswith("grad_") for name in failed), str(report)
    assert "loss" not in failed  # step 1's forward is untouched


def test_nan_where_the_reference_is_finite_fails(monkeypatch):
    _patch_conversion(monkeypatch, lambda model: _scale_value(model, "grad_fc1.weight", math.nan))
    report = bridge.verify(MLP, "mse", "sgd", steps=1)
    rows = {row.name: row for row in report.rows}
    assert not rows["grad_fc1.weight"].passed and rows["grad_fc1.weight"].error == math.inf


# --- a wrong converter: the forward against onnxruntime -----------------------------------------

def _leaky_relu(original):
    return lambda ctx, x: torch.where(x > 0, x, 0.01 * x)  # Relu read as a LeakyRelu


def _gemm_weight_scaled(original):
    return lambda ctx, a, b, c=None: original(ctx, a, b * 1.0001, c)  # 1e-4 of the product: subtle


@pytest.mark.parametrize("op_type, wrong", [("Relu", _leaky_relu), ("Gemm", _gemm_weight_scaled)])
def test_wrong_converter_forward_fails(monkeypatch, op_type, wrong):
    """A converter whose forward is wrong makes the training graph and the eager reference wrong alike
    (both run the imported program): only onnxruntime on the source model shows it."""
    import_all_converters()
    converter = CONVERTERS[op_type]
    monkeypatch.setitem(CONVERTERS, op_type, dataclasses.replace(converter, fn=wrong(converter.fn)))
    report = bridge.verify(MLP, "ce", "adam")
    assert _failed(report) == {"forward logits"}, str(report)
    assert "FAIL" in str(report).splitlines()[-1] and "forward logits" in str(report).splitlines()[-1]


def test_forward_runs_where_onnxruntime_cannot():
    """onnxruntime has no batch-major GRU kernel (``layout=1``): ONNX's reference evaluator runs the
    source model instead, and the forward is still checked."""
    case = bigru_regressor()
    report = bridge.verify(case.model, case.loss, "adam", steps=1, fd_max=0)
    assert report.passed, str(report)
    assert any(row.name.startswith("forward ") for row in report.rows)


def test_outputs_of_random_ops_are_not_compared_with_onnxruntime():
    """onnxruntime draws its own random values: an output computed from RandomUniformLike has no
    forward row; the deterministic output beside it has one."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul"),
             helper.make_node("RandomUniformLike", ["y"], ["u"], name="draw"),
             helper.make_node("Add", ["y", "u"], ["noisy"], name="add")]
    graph = helper.make_graph(nodes, "random", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 2]),
                               helper.make_tensor_value_info("noisy", onnx.TensorProto.FLOAT, [4, 2])],
                              [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    report = bridge.verify(model, "mse", "sgd", steps=1)
    assert report.passed, str(report)
    assert {row.name for row in report.rows if row.name.startswith("forward ")} == {"forward y"}


def test_scaled_error_and_tolerance_rule():
    assert verify_module.scaled_error(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == pytest.approx(0.25)
    assert verify_module.scaled_error(np.array([1.0, 0.5]), np.array([np.inf, 2.0])) == pytest.approx(0.75)  # finite part
    assert verify_module.scale_of(np.array([-3.0, np.nan, 2.0])) == 3.0 and verify_module.scale_of(np.zeros(0)) == 0.0
    assert verify_module.scaled_error(np.zeros(2), np.zeros(2)) == 0.0
    assert verify_module.scaled_error(np.zeros(3), np.zeros(2)) == math.inf
    row = verify_module.Row("grad_w", 1, error=3e-6, noise=4e-7, limit=4e-6)
    assert row.passed and row.ratio == pytest.approx(7.5)
    assert not verify_module.Row("grad_w", 1, error=math.nan, noise=0.0, limit=1e-6).passed


def test_as_float64_leaves_no_float32_step():
    """``as_float64`` (verify's reference and the test oracles' float64 models): an addend float32
    rounding loses (1e-10 on 1.0) survives every float32 place in the model, an If branch included."""
    tiny = float(np.float32(1e-10))
    then_branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c2"], value=numpy_helper.from_array(np.asarray(tiny, np.float32))),
         helper.make_node("Add", ["z", "c2"], ["out"])], "then", [],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["z"], ["out"])], "else", [],
                                    [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("Cast", ["xw"], ["cast"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Constant", [], ["c1"], value_float=tiny),
             helper.make_node("Add", ["cast", "c1"], ["z"]),
             helper.make_node("If", ["flag"], ["y"], then_branch=then_branch, else_branch=else_branch)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.ones(2, np.float32), "w"),
                               numpy_helper.from_array(np.asarray(True), "flag")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model64 = verify_module.as_float64(model)
    onnx.checker.check_model(model64, full_check=True)
    (y,) = ReferenceEvaluator(model64).run(None, {"x": np.ones(2)})
    assert y.dtype == np.float64 and np.all(y == 1.0 + tiny + tiny)
    assert verify_module.scaled_error(y, np.ones(2)) == pytest.approx(2 * tiny)
    (y32,) = ReferenceEvaluator(model).run(None, {"x": np.ones(2, np.float32)})
    assert np.all(y32 == 1.0)  # what the float32 model computes


def test_bad_options_raise():
    with pytest.raises(bridge.InvalidOptionError, match="steps"):
        bridge.verify(MLP, steps=0)
    with pytest.raises(bridge.InvalidOptionError, match="unknown loss"):
        bridge.verify(MLP, loss="nope")


# --- the command line -------------------------------------------------------------------------

def test_cli_passes_with_exit_0(capsys):
    assert main(["verify", MLP, "--loss", "mse", "--optim", "sgd", "--steps", "2",
                 "--optim-options", '{"lr": 0.05, "momentum": 0.9}']) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("PASS") and any(line.startswith("updated_fc1.weight.momentum_buffer") for line in out)


def test_cli_mismatch_exits_1_naming_the_tensor(monkeypatch, capsys):
    _patch_conversion(monkeypatch, lambda model: _scale_value(model, "grad_fc2.bias", 1.01))
    assert main(["verify", MLP, "--steps", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("FAIL") and "grad_fc2.bias" in out[-1]
    assert any(line.startswith("grad_fc2.bias") and line.endswith("FAIL") for line in out)


@pytest.mark.parametrize("args, message", [
    (["missing.onnx"], "does not exist"),
    ([MLP, "--optim-options", "{lr: 1}"], "--optim-options: not valid JSON"),
    ([MLP, "--loss-options", "[1]"], "--loss-options: give a JSON object"),
    ([MLP, "--optim", "nope"], "unknown optimizer"),
])
def test_cli_errors_exit_2_with_one_line(args, message, capsys):
    assert main(["verify", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("bridge: error:") and message in captured.err
    assert "Traceback" not in captured.err


# --- zoo models -------------------------------------------------------------------------------

def _zoo_case(name: str, tmp_path: Path) -> tuple[onnx.ModelProto | str, str]:
    """A zoo model (hand-built case name, or '<torch model>-<exporter>') and its loss."""
    handbuilt = {build.__name__: build for build in CASES}
    if name in handbuilt:
        case = handbuilt[name]()
        return case.model, case.loss
    model, exporter = name.rsplit("-", 1)
    module, inputs, _, loss = {**TEXT, **VISION}[model]()
    return export(module, inputs, exporter, tmp_path / f"{model}.onnx"), loss


def _first_exporter(matrix) -> list[str]:
    first: dict[str, str] = {}
    for model, exporter, *_ in matrix:
        first.setdefault(model, exporter)
    return [f"{model}-{exporter}" for model, exporter in first.items()]


FAST_ZOO = [lstm_classifier.__name__, layernorm_gelu.__name__, "bert-legacy17", "lstm_tagger-legacy13"]
ALL_ZOO = [build.__name__ for build in CASES] + _first_exporter(TEXT_MATRIX) + _first_exporter(VISION_MATRIX)


def _assert_zoo_passes(name: str, tmp_path: Path) -> None:
    model, loss = _zoo_case(name, tmp_path)
    report = bridge.verify(model, loss, "adam", optim_options={"lr": 1e-2})
    assert report.passed, f"{name}:\n{report}"


# make test-fast verifies the hand-built ones; CI also a torch export (the LSTM tagger: ~15 s);
# BERT's is exhaustive (test_zoo_text.py checks BERT's legacy17 export in CI, against torch).
ZOO_TIER = {"lstm_tagger-legacy13": pytest.mark.slow, "bert-legacy17": pytest.mark.exhaustive}


@pytest.mark.parametrize("name", [pytest.param(n, marks=ZOO_TIER.get(n, ())) for n in FAST_ZOO])
def test_zoo_model_passes(name, tmp_path):
    _assert_zoo_passes(name, tmp_path)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", [n for n in ALL_ZOO if n not in FAST_ZOO])
def test_every_zoo_model_passes(name, tmp_path):
    _assert_zoo_passes(name, tmp_path)
