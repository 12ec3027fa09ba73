"""Bad input gets a BridgeError that names the culprit, and leaves no output file; a write that
fails midway leaves no file either, and the previous files as they were."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.cli import main
from bridge.training import training_model

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "models" / "mlp.onnx")


def test_missing_file(tmp_path):
    with pytest.raises(bridge.ModelLoadError, match="nope.onnx"):
        bridge.to_training_onnx(tmp_path / "nope.onnx")


def test_not_an_onnx_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_text("this is not protobuf")
    out = tmp_path / "train.onnx"
    with pytest.raises(bridge.ModelLoadError, match="bad.onnx"):
        bridge.to_training_onnx(bad, output_path=out)
    assert not out.exists()


@pytest.mark.parametrize("kwargs, culprit", [
    ({"loss": "hinge"}, "hinge"),
    ({"optim": "lbfgs"}, "lbfgs"),
    ({"optim": "adam", "optim_options": {"betas": (0.9, 1.5)}}, "beta"),
    ({"optim": "sgd", "optim_options": {"lr": -1.0}}, "learning rate"),
    ({"optim": "sgd", "optim_options": {"momentun": 0.9}}, "momentun"),
    ({"loss": "mse", "loss_options": {"reduktion": "sum"}}, "reduktion"),
    ({"frozen": ["conv*"]}, "conv\\*"),
    ({"output": "probabilities"}, "probabilities"),
])
def test_invalid_options_name_the_culprit(tmp_path, kwargs, culprit):
    out = tmp_path / "train.onnx"
    with pytest.raises(bridge.InvalidOptionError, match=culprit):
        bridge.to_training_onnx(EXAMPLE, output_path=out, **kwargs)
    assert not out.exists()


def test_unknown_names_list_the_choices():
    with pytest.raises(bridge.InvalidOptionError, match="rmsprop"):
        bridge.to_training_onnx(EXAMPLE, optim="lbfgs")
    with pytest.raises(bridge.InvalidOptionError, match="mse"):
        bridge.to_training_onnx(EXAMPLE, loss="hinge")


def test_unsupported_ops_are_listed_up_front():
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
            helper.make_node("Det", ["h"], ["d"], name="det_a"),
            helper.make_node("Custom", ["d"], ["y"], name="mystery", domain="com.example"),
        ],
        "unsupported",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.eye(2, dtype=np.float32), "W")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    with pytest.raises(bridge.UnsupportedOpError) as info:
        bridge.to_training_onnx(model)
    assert "Det (nodes: det_a)" in str(info.value) and "com.example::Custom (nodes: mystery)" in str(info.value)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    code = main(["convert", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "t.onnx")])
    assert code == 2
    assert "missing.onnx" in capsys.readouterr().err
    assert not (tmp_path / "t.onnx").exists()


def _mul_model(data_name: str, weight_name: str = "w", shape=(2, 3)):
    x = np.ones(shape, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", [data_name, weight_name], ["y"])], "mul",
        [helper.make_tensor_value_info(data_name, TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(x, weight_name)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("data_name, weight_name", [("target", "w"), ("x", "lr"), ("step", "w")])
def test_source_value_named_like_the_contract(data_name, weight_name):
    """A source value named like a training-graph input or output (the ONNX node suite's
    nllloss_*_expanded models have an input 'target') is refused, naming it."""
    with pytest.raises(bridge.BridgeError, match=f"'{data_name if data_name != 'x' else weight_name}'"):
        bridge.to_training_onnx(_mul_model(data_name, weight_name))


def test_empty_model_output():
    with pytest.raises(bridge.ShapeError, match="'y' is empty"):
        bridge.to_training_onnx(_mul_model("x", shape=(2, 0)))


@pytest.mark.parametrize("op_type, attrs", [("NonZero", {}), ("Unique", {}), ("Compress", {"axis": 1})])
def test_output_size_decided_by_data_names_the_node(op_type, attrs):
    """NonZero, Unique and Compress convert only where the values that decide their output size
    are known before the model runs (issue 12)."""
    inputs = ["h", "positive"] if op_type == "Compress" else ["h"]
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "W"], ["h"], name="scale"),
            helper.make_node("Greater", ["h", "zero"], ["positive"], name="sign"),
            helper.make_node(op_type, inputs, ["picked"], name="selector", **attrs),
        ],
        "data_dependent_size",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("picked", TensorProto.FLOAT if op_type != "NonZero" else TensorProto.INT64,
                                       ["n"])],
        [numpy_helper.from_array(np.ones(3, np.float32), "W"), numpy_helper.from_array(np.zeros((), np.float32), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(bridge.ShapeError, match=f"{op_type} node 'selector'.*known before the model runs"):
        bridge.to_training_onnx(model)


# Bad options are refused before anything is written (above); these writes fail after part of a
# file is on disk: the save is atomic (bridge/atomic.py), so nothing appears and what was there stays.
SAVED = ["train.onnx", "train.eval.onnx", "train.gradient.onnx", "train.update.onnx", "state.npz"]


def _full_disk_at(monkeypatch, failing_call: int) -> list[Path]:
    """``stream_model`` (bridge's one model writer) writes its files for real, except its
    ``failing_call``-th: half the bytes, then ENOSPC (a full disk). Returns the paths it was given."""
    real_stream, calls = training_model.stream_model, []

    def stream(model, path, *args, **kwargs):
        calls.append(Path(path))
        if len(calls) < failing_call:
            return real_stream(model, path, *args, **kwargs)
        data = model.SerializeToString()
        Path(path).write_bytes(data[:len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(training_model, "stream_model", stream)
    return calls


@pytest.mark.parametrize("failing_call", [1, 4], ids=["first_graph", "last_graph"])
def test_a_write_failing_midway_leaves_the_previous_files(tmp_path, monkeypatch, failing_call):
    previous = {name: f"previous {name}".encode() for name in SAVED}
    for name, data in previous.items():
        (tmp_path / name).write_bytes(data)
    calls = _full_disk_at(monkeypatch, failing_call)
    tm = bridge.to_training_onnx(EXAMPLE)
    with pytest.raises(OSError, match="No space left"):
        tm.save(tmp_path / "train.onnx", state_path=tmp_path / "state.npz")
    assert len(calls) == failing_call and all(path.parent == tmp_path and path.name not in SAVED for path in calls), (
        "the graphs must be written to temporaries beside their targets")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == previous, "a target or a temporary changed"


def test_output_path_write_failing_midway_leaves_nothing(tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, 2)
    with pytest.raises(OSError, match="No space left"):
        bridge.to_training_onnx(EXAMPLE, output_path=tmp_path / "out" / "train.onnx")
    assert [p.name for p in (tmp_path / "out").iterdir()] == []
