"""``bridge.check(model, target="onnx-mlir")``: clean on bridge's graphs, and each kind of
violation caught on a small hand-built graph, with the node, the op and onnx-mlir's own text.
Where onnx-mlir is installed, a graph the table accepts is compiled too and onnx-mlir's errors are
violations of the node they name; without it the table alone is checked, and the CLI says so."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers.models import gemm_mlp, matmul_add_mlp
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.cli import main
from bridge.errors import InvalidOptionError
from bridge.tools.compile import onnx_mlir_diagnostics
from bridge.tools.target_check import onnx_mlir_missing

TABLE = json.loads((Path(bridge.__file__).parent / "data" / "onnx_mlir_cpu_ops.json").read_text())["ops"]
F, I64 = TensorProto.FLOAT, TensorProto.INT64
ONNX_MLIR_MISSING = onnx_mlir_missing()
needs_onnx_mlir = pytest.mark.skipif(ONNX_MLIR_MISSING is not None, reason=f"onnx-mlir is not available: {ONNX_MLIR_MISSING}")


@pytest.mark.parametrize("optim", ["sgd", "adam", "rmsprop"])
@pytest.mark.parametrize("loss", ["mse", "ce"])
@pytest.mark.parametrize("build", [matmul_add_mlp, gemm_mlp], ids=["matmul_add", "gemm"])
def test_bridge_graphs_are_clean(build, loss, optim):
    tm = bridge.to_training_onnx(build()[0], loss=loss, optim=optim)
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []


def _model(nodes, inputs, outputs, initializers=(), opset=18, domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "bad",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        list(initializers),
    )
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=imports)


def _const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


X = [("x", F, [1, 2, 4, 4])]
Y = [("y", F, None)]

BAD = {
    "unsupported_op": (_model([helper.make_node("RandomNormalLike", ["x"], ["y"], name="n")], X, Y), "RandomNormalLike", "not supported"),
    "bernoulli": (_model([helper.make_node("Bernoulli", ["x"], ["y"], name="n")], X, Y), "Bernoulli", "not supported"),
    "unknown_op": (_model([helper.make_node("Gradient", ["x"], ["y"], name="n", xs=["x"], y="x")], X, Y), "Gradient", "not supported"),
    "opset_too_old": (_model([helper.make_node("ArgMin", ["x"], ["y"], name="n")], X, Y, opset=11), "ArgMin", "outside the supported range 13..22"),
    "custom_domain": (_model([helper.make_node("Foo", ["x"], ["y"], name="n", domain="com.acme")], X, Y, domains=["com.acme"]), "Foo", "non-default domain"),
    "maxpool_indices": (
        _model([helper.make_node("MaxPool", ["x"], ["y", "idx"], name="n", kernel_shape=[2, 2])], X, Y + [("idx", I64, None)]),
        "MaxPool", "Indices output",
    ),
    "reshape_allowzero": (
        _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="n", allowzero=1)], X, Y, [_const("s", [2, 16])]),
        "Reshape", "allowzero=1",
    ),
    "reduce_keepdims": (
        _model([helper.make_node("ReduceMean", ["x", "a"], ["y"], name="n", keepdims=0)], X, Y, [_const("a", [1])]),
        "ReduceMean", "keepdims=0",
    ),
    "reducesum_no_axes": (_model([helper.make_node("ReduceSum", ["x"], ["y"], name="n")], X, Y), "ReduceSum", "no axes"),
    "convtranspose_weight": (
        _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="n")], X + [("w", F, [2, 3, 3, 3])], Y),
        "ConvTranspose", "not a constant",
    ),
    "convtranspose_asymmetric": (
        _model([helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="n", pads=[0, 0, 1, 1])], X, Y,
               [_const("w", np.ones((2, 3, 3, 3), np.float32))]),
        "ConvTranspose", "asymmetric pads",
    ),
    "resize_linear": (
        _model([helper.make_node("Resize", ["x", "", "sc"], ["y"], name="n", mode="linear")], X, Y,
               [_const("sc", np.array([1, 1, 2, 2], np.float32))]),
        "Resize", "mode=linear",
    ),
    "resize_cubic": (
        _model([helper.make_node("Resize", ["x", "", "sc"], ["y"], name="n", mode="cubic")], X, Y,
               [_const("sc", np.array([1, 1, 2, 2], np.float32))]),
        "Resize", "mode=cubic",
    ),
    "cast_to_bfloat16": (
        _model([helper.make_node("Cast", ["x"], ["y"], name="n", to=TensorProto.BFLOAT16)], X, [("y", TensorProto.BFLOAT16, None)]),
        "Cast", "cast to BFLOAT16",
    ),
    "dropout_training": (
        _model([helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="n")], X + [("t", TensorProto.BOOL, [])], Y,
               [_const("r", np.float32(0.5))]),
        "Dropout", "training mode",
    ),
    "dropout_mask": (
        _model([helper.make_node("Dropout", ["x"], ["y", "m"], name="n")], X, Y + [("m", TensorProto.BOOL, None)]),
        "Dropout", "mask output",
    ),
    "batchnorm_training": (
        _model([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], name="n", training_mode=1)],
               X, Y + [("rm", F, None), ("rv", F, None)],
               [_const(k, np.ones(2, np.float32)) for k in "sbmv"]),
        "BatchNormalization", "training mode",
    ),
    "scatter_elements_reduction": (
        _model([helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], name="n", reduction="add")],
               [("d", F, [4]), ("u", F, [2])], Y, [_const("i", np.array([0, 1]))]),
        "ScatterElements", "reduction=add",
    ),
    "scatter_elements_duplicates": (
        _model([helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], name="n")],
               [("d", F, [4]), ("u", F, [2])], Y, [_const("i", np.array([1, 1]))]),
        "ScatterElements", "duplicate indices",
    ),
    "scatter_nd_reduction": (
        _model([helper.make_node("ScatterND", ["d", "i", "u"], ["y"], name="n", reduction="add")],
               [("d", F, [4]), ("u", F, [2])], Y, [_const("i", np.array([[0], [1]]))]),
        "ScatterND", "reduction=add",
    ),
    "logsoftmax_axis1": (_model([helper.make_node("LogSoftmax", ["x"], ["y"], name="n", axis=1)], X, Y), "LogSoftmax", "axis 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_each_violation_kind_is_reported(case):
    model, op, problem = BAD[case]
    violations = bridge.check(model, target="onnx-mlir")
    assert len(violations) == 1, [str(v) for v in violations]
    (v,) = violations
    assert v.op == op and problem in v.problem and v.node == "n"
    if op in TABLE and TABLE[op]["supported"]:
        assert v.limitation == TABLE[op]["limitations"]
    assert v.node in str(v) and op in str(v)


def test_opset_above_22_is_reported_for_the_model_and_each_node():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="n")], X, Y, opset=23)
    assert [(v.node, v.op, v.problem) for v in bridge.check(model)] == [
        ("", "opset", "default-domain opset 23; onnx-mlir supports up to 22"),
        ("n", "Relu", "opset 23 outside the supported range 6..22"),
    ]


def test_clean_forms_of_the_same_ops_pass():
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("ReduceSum", ["p", "a"], ["r"], name="sum", keepdims=1),
        helper.make_node("Cast", ["r"], ["c"], name="cast", to=TensorProto.DOUBLE),
        helper.make_node("Resize", ["x", "", "sc"], ["z"], name="resize", mode="nearest"),
        helper.make_node("Dropout", ["c"], ["y"], name="drop"),
    ]
    inits = [_const("a", [1]), _const("sc", np.array([1, 1, 2, 2], np.float32))]
    model = _model(nodes, X, [("y", TensorProto.DOUBLE, None), ("z", F, None)], inits)
    assert bridge.check(model, compile=False) == []


def test_violations_inside_subgraphs_are_found():
    body = helper.make_graph([helper.make_node("Bernoulli", ["x"], ["o"], name="inner")], "body", [], [helper.make_tensor_value_info("o", F, None)])
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=body, else_branch=body)
    model = _model([node], X + [("c", TensorProto.BOOL, [])], Y)
    assert [(v.node, v.op) for v in bridge.check(model)] == [("inner", "Bernoulli"), ("inner", "Bernoulli")]


def test_unknown_target_is_an_error():
    with pytest.raises(InvalidOptionError, match="unknown check target 'tvm'"):
        bridge.check(matmul_add_mlp()[0], target="tvm")


def test_cli_check_exit_status(tmp_path, capsys):
    clean = bridge.to_training_onnx(matmul_add_mlp()[0], loss="mse", optim="sgd").save(tmp_path / "train.onnx")
    assert main(["check", str(clean), "--target", "onnx-mlir", "--no-compile"]) == 0
    assert "0 violation(s)" in capsys.readouterr().out
    bad = tmp_path / "bad.onnx"
    onnx.save(BAD["maxpool_indices"][0], str(bad))
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "n (MaxPool)" in out and TABLE["MaxPool"]["limitations"] in out and "1 violation(s)" in out


def _bicubic_grid_sample(extra=()) -> onnx.ModelProto:
    """GridSample in bicubic mode: valid ONNX and in onnx-mlir's table (2-D, zeros padding), but onnx-mlir's
    CPU lowering has no cubic form ("failed to legalize operation 'onnx.GridSample'")."""
    node = helper.make_node("GridSample", ["x", "g"], ["y"], name="n", mode="bicubic")
    return _model([node, *extra], [("x", F, [1, 1, 4, 4]), ("g", F, [1, 2, 2, 2])],
                  [("y", F, [1, 1, 2, 2])] + [(out, F, None) for e in extra for out in e.output])


@pytest.mark.onnx_mlir
@needs_onnx_mlir
def test_onnx_mlir_compile_errors_are_violations_of_the_node():
    model = _bicubic_grid_sample()
    assert bridge.check(model, compile=False) == []
    (violation,) = bridge.check(model)
    assert (violation.node, violation.op) == ("n", "GridSample") and violation.problem.startswith("onnx-mlir: ")
    # the table's violations come first: no compile while the table finds something
    pooled = _bicubic_grid_sample([helper.make_node("MaxPool", ["x"], ["p", "idx"], name="pool", kernel_shape=[2, 2])])
    assert [(v.node, v.op) for v in bridge.check(pooled)] == [("pool", "MaxPool")]


@pytest.mark.onnx_mlir
@needs_onnx_mlir
def test_cli_check_compiles_unless_told_not_to(tmp_path, capsys):
    clean = bridge.to_training_onnx(matmul_add_mlp()[0], loss="mse", optim="sgd").save(tmp_path / "train.onnx")
    assert main(["check", str(clean)]) == 0
    captured = capsys.readouterr()
    assert "0 violation(s)" in captured.out and "onnx-mlir [1/6]" in captured.err, captured.err
    bad = tmp_path / "grid.onnx"
    onnx.save(_bicubic_grid_sample(), str(bad))
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "n (GridSample): onnx-mlir: " in out and "1 violation(s)" in out, out
    assert main(["check", str(bad), "--no-compile"]) == 0
    assert "onnx-mlir [" not in capsys.readouterr().err


@pytest.mark.parametrize("where", ["ONNX_MLIR_HOME empty", "PATH without onnx-mlir"])
def test_without_onnx_mlir_the_table_alone_is_checked_and_the_cli_says_so(where, tmp_path, monkeypatch, capsys):
    if where == "ONNX_MLIR_HOME empty":
        monkeypatch.setenv("ONNX_MLIR_HOME", str(tmp_path))
    else:
        monkeypatch.delenv("ONNX_MLIR_HOME", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    assert "ONNX_MLIR_HOME" in onnx_mlir_missing()
    model = _bicubic_grid_sample()
    assert bridge.check(model) == []  # onnx-mlir would reject it; the table accepts it
    path = tmp_path / "grid.onnx"
    onnx.save(model, str(path))
    assert main(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert "op table only: onnx-mlir not found (ONNX_MLIR_HOME" in err, err
    assert main(["check", str(path), "--no-compile"]) == 0
    assert "op table only" not in capsys.readouterr().err


def test_an_onnx_mlir_error_without_a_node_name_is_the_only_node_of_its_type():
    """onnx-mlir's "failed to legalize operation 'onnx.<Op>'" names no node: it is the node when the
    graph has one node of that op type, and no node when it has several."""
    log = "[2/6] Compiling and Optimizing MLIR Module\nfailed to legalize operation 'onnx.GridSample'"
    one = _bicubic_grid_sample()
    assert [d[:2] for d in onnx_mlir_diagnostics(log, one)] == [("n", "GridSample")]
    two = _bicubic_grid_sample([helper.make_node("GridSample", ["x", "g"], ["z"], name="m")])
    assert [d[:2] for d in onnx_mlir_diagnostics(log, two)] == [("", "GridSample")]
