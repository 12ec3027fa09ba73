"""Inputs pinned to values (``constant_inputs=``, ``--constant-input``) and shape folding over shape-only
computations, checked against float64 central finite differences of the source model in onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import bridge
from bridge.cli import main
from bridge.errors import InvalidOptionError, ShapeError
from bridge.pipeline.load import PromotedConstantsWarning

RNG = np.random.RandomState(0)
W0 = RNG.randn(4, 3)
B0 = RNG.randn(3)


def _if_model(flag_type=T.BOOL, dtype=T.FLOAT) -> onnx.ModelProto:
    """``y = If(flag, Tanh(x @ W), Sigmoid(x @ W) * 2)``: two branches of different ops."""
    then = h.make_graph([h.make_node("Tanh", ["xw"], ["t"])], "then", [], [h.make_tensor_value_info("t", dtype, None)])
    two = h.make_tensor("two", dtype, [], [2.0])
    other = h.make_graph([h.make_node("Sigmoid", ["xw"], ["s"]), h.make_node("Constant", [], ["c2"], value=two),
                          h.make_node("Mul", ["s", "c2"], ["e"])], "else", [], [h.make_tensor_value_info("e", dtype, None)])
    cond = [h.make_node("Cast", ["flag"], ["cond"], to=T.BOOL)] if flag_type != T.BOOL else [
        h.make_node("Identity", ["flag"], ["cond"])]
    nodes = [h.make_node("MatMul", ["x", "W"], ["xw0"]), h.make_node("Add", ["xw0", "B"], ["xw"]), *cond,
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    npdt = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    graph = h.make_graph(nodes, "if_flag", [h.make_tensor_value_info("x", dtype, [2, 4]),
                                             h.make_tensor_value_info("flag", flag_type, [])],
                         [h.make_tensor_value_info("y", dtype, [2, 3])],
                         [nh.from_array(W0.astype(npdt), "W"), nh.from_array(B0.astype(npdt), "B")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


# The leading size of the Reshape's shape, computed from b = Gather(Shape(y), 0) as exporters do:
# tf2onnx's Max(b, 1); Min(b, 12 * b); Where(b == 0, 1, b) (a 0 in the shape means "copy").
SIZE_FROM_SHAPE = {
    "Max": [h.make_node("Max", ["b", "one"], ["m"])],
    "Min": [h.make_node("Mul", ["b", "twelve"], ["b12"]), h.make_node("Min", ["b", "b12"], ["m"])],
    "Where": [h.make_node("Equal", ["b", "zero"], ["empty"]), h.make_node("Where", ["empty", "one", "b"], ["m"])],
}


def _reshape_model(batch, dtype=T.FLOAT, size="Max") -> onnx.ModelProto:
    """tf2onnx's Reshape: its shape is ``Concat(size, [4, 3])``, ``size`` one of ``SIZE_FROM_SHAPE``."""
    npdt = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    inits = [nh.from_array(RNG.randn(6, 12).astype(npdt), "W"), nh.from_array(np.array([1], np.int64), "one"),
             nh.from_array(np.array([0], np.int64), "zero"), nh.from_array(np.array([4, 3], np.int64), "rest"),
             nh.from_array(np.array([12], np.int64), "twelve")]
    nodes = [h.make_node("MatMul", ["x", "W"], ["y"]), h.make_node("Shape", ["y"], ["s"]),
             h.make_node("Gather", ["s", "zero"], ["b"], axis=0), *SIZE_FROM_SHAPE[size],
             h.make_node("Concat", ["m", "rest"], ["shape"], axis=0), h.make_node("Reshape", ["y", "shape"], ["r"]),
             h.make_node("Tanh", ["r"], ["out"])]
    graph = h.make_graph(nodes, "reshape", [h.make_tensor_value_info("x", dtype, [batch, 6])],
                         [h.make_tensor_value_info("out", dtype, [batch, 4, 3])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def _as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    from bridge.tools.verify import as_float64
    return as_float64(model)


def _fd_gradient(model64, feeds, weight, target, h_=1e-6):
    """Central finite differences of the mse loss of ``model64`` (onnxruntime) w.r.t. initializer ``weight``."""
    from helpers.oracle import weights_as_inputs
    value = {i.name: nh.to_array(i) for i in model64.graph.initializer}[weight].astype(np.float64)
    session = ort.InferenceSession(weights_as_inputs(model64, [weight]).SerializeToString(),
                                   providers=["CPUExecutionProvider"])

    def loss(w):
        out = session.run(None, {**feeds, weight: w})[0]
        return np.mean((out - target) ** 2)

    grad = np.zeros_like(value)
    for index in np.ndindex(value.shape):
        plus, minus = value.copy(), value.copy()
        plus[index] += h_
        minus[index] -= h_
        grad[index] = (loss(plus) - loss(minus)) / (2 * h_)
    return grad


def _step_gradients(tm, feeds, target):
    session = tm.session()
    result = session.step(feeds, target)
    return {k.removeprefix("grad_"): v for k, v in result.items() if k.startswith("grad_")}


@pytest.mark.parametrize("flag", [True, False])
def test_pinned_flag_folds_the_if_and_trains_its_branch(flag):
    model = _if_model()
    tm = bridge.to_training_onnx(model, constant_inputs={"flag": int(flag)})
    assert "flag" not in [i.name for i in tm.model.graph.input]
    assert "flag" not in [i.name for i in tm.eval_model.graph.input]
    x = RNG.randn(2, 4).astype(np.float32)
    target = RNG.randn(2, 3).astype(np.float32)
    grads = _step_gradients(tm, {"x": x}, target)
    model64 = _as_float64(model)
    feeds = {"x": x.astype(np.float64), "flag": np.array(flag)}
    for weight in ("W", "B"):
        want = _fd_gradient(model64, feeds, weight, target.astype(np.float64))
        np.testing.assert_allclose(grads[weight], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # the two branches give different gradients: the pin decides which one trains
    other = _fd_gradient(model64, {**feeds, "flag": np.array(not flag)}, "W", target.astype(np.float64))
    assert np.abs(grads["W"] - other).max() > 1e-2 * np.abs(other).max()


def test_exported_inference_model_keeps_the_pin(tmp_path):
    tm = bridge.to_training_onnx(_if_model(), constant_inputs={"flag": 0})
    path = tm.export_inference(tmp_path / "inference.onnx", tm.initial_state())
    exported = onnx.load(path)
    assert [i.name for i in exported.graph.input] == ["x"]
    x = RNG.randn(2, 4).astype(np.float32)
    got = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    source = ort.InferenceSession(_if_model().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, source.run(None, {"x": x, "flag": np.array(False)})[0], rtol=1e-6)


def test_int_flag_pinned():
    tm = bridge.to_training_onnx(_if_model(flag_type=T.INT64), constant_inputs={"flag": 1})
    assert [i.name for i in tm.model.graph.input if i.name in ("x", "flag")] == ["x"]


def test_unpinned_if_on_data_says_how_to_pin():
    with pytest.raises(ShapeError, match=r"If node .*input 0 .*must be known before the model runs.*constant_inputs="
                                          r".*--constant-input"):
        bridge.to_training_onnx(_if_model())


def test_pin_of_an_unknown_input_is_refused():
    with pytest.raises(InvalidOptionError, match=r"constant_inputs names 'flg'.*inputs are \['x', 'flag'\]"):
        bridge.to_training_onnx(_if_model(), constant_inputs={"flg": 1})


def test_pin_of_a_weight_is_refused():
    with pytest.raises(InvalidOptionError, match="constant_inputs names 'W'"):
        bridge.to_training_onnx(_if_model(), constant_inputs={"W": 1})


@pytest.mark.parametrize(("value", "message"), [(2, "not a value of input 'flag'"), ([1, 0], "has shape \\[2\\]"),
                                                ("yes", "not a value of input 'flag'")])
def test_pin_of_a_wrong_value_is_refused(value, message):
    with pytest.raises((InvalidOptionError, ShapeError), match=message):
        bridge.to_training_onnx(_if_model(), constant_inputs={"flag": value})


@pytest.mark.parametrize("size", sorted(SIZE_FROM_SHAPE))
@pytest.mark.parametrize("batch", [3, "N"])
def test_reshape_from_shape_arithmetic_trains(batch, size):
    model = _reshape_model(batch, size=size)
    tm = bridge.to_training_onnx(model)
    x = RNG.randn(3, 6).astype(np.float32)
    target = RNG.randn(3, 4, 3).astype(np.float32)
    grads = _step_gradients(tm, {"x": x}, target)
    want = _fd_gradient(_as_float64(model), {"x": x.astype(np.float64)}, "W", target.astype(np.float64))
    np.testing.assert_allclose(grads["W"], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_max_of_symbolic_batch_and_a_larger_constant_is_refused():
    model = _reshape_model("N")
    for init in model.graph.initializer:
        if init.name == "one":
            init.CopyFrom(nh.from_array(np.array([5], np.int64), "one"))
    with pytest.raises(ShapeError, match="Max node 'Max_3' compares the symbolic size"):
        bridge.to_training_onnx(model, batch_size=6)  # valid at 6, not at every batch size


def test_cli_constant_input(tmp_path, capsys):
    source = tmp_path / "model.onnx"
    onnx.save(_if_model(), source)
    out = tmp_path / "model.train.onnx"
    assert main(["convert", str(source), "-o", str(out), "--constant-input", "flag=1"]) == 0
    assert "flag" not in [i.name for i in onnx.load(out).graph.input]
    capsys.readouterr()
    assert main(["convert", str(source), "-o", str(tmp_path / "b.onnx"), "--constant-input", "flag"]) != 0
    assert "--constant-input: give NAME=VALUE" in capsys.readouterr().err


def _branch_weights_model() -> onnx.ModelProto:
    """spox's silero_vad in small: ``If(sr == 16000, tanh(x @ W16 + b16), sigmoid(x @ W8 + b8))`` over float64,
    each branch's weights Constant nodes inside it, and no initializer."""
    def branch(name: str, op: str, seed: int) -> onnx.GraphProto:
        rng = np.random.default_rng(seed)
        weights = [h.make_node("Constant", [], [f"{name}.W"], value=nh.from_array(rng.standard_normal((4, 3)))),
                   h.make_node("Constant", [], [f"{name}.b"], value=nh.from_array(rng.standard_normal(3)))]
        math = [h.make_node("MatMul", ["x", f"{name}.W"], [f"{name}.xw"]),
                h.make_node("Add", [f"{name}.xw", f"{name}.b"], [f"{name}.z"]), h.make_node(op, [f"{name}.z"], [f"{name}.y"])]
        return h.make_graph(weights + math, name, [], [h.make_tensor_value_info(f"{name}.y", T.DOUBLE, None)])

    nodes = [h.make_node("Constant", [], ["rate"], value=nh.from_array(np.array(16000, np.int64))),
             h.make_node("Equal", ["sr", "rate"], ["is16k"]),
             h.make_node("If", ["is16k"], ["y"], then_branch=branch("k16", "Tanh", 1), else_branch=branch("k8", "Sigmoid", 2))]
    graph = h.make_graph(nodes, "branch_weights", [h.make_tensor_value_info("x", T.DOUBLE, [2, 4]),
                                                   h.make_tensor_value_info("sr", T.INT64, [])],
                         [h.make_tensor_value_info("y", T.DOUBLE, [2, 3])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def _branch_constants(model: onnx.ModelProto, branch: str) -> dict[str, np.ndarray]:
    graph = next(a.g for a in model.graph.node[2].attribute if a.name == branch)
    return {n.output[0]: nh.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"}


@pytest.mark.parametrize(("rate", "branch", "activation"), [(16000, "then_branch", torch.tanh),
                                                            (8000, "else_branch", torch.sigmoid)])
def test_weights_inside_the_branch_a_pin_decides_train(rate, branch, activation):
    """The pinned ``sr`` decides the If before Constant weights are promoted: the taken branch's Constants
    are the weights, under their output names, with torch's float64 gradients."""
    model = _branch_weights_model()
    with pytest.warns(PromotedConstantsWarning):
        tm = bridge.to_training_onnx(model, constant_inputs={"sr": rate})
    values = _branch_constants(model, branch)
    assert sorted(tm.weights) == sorted(values)
    x, target = RNG.randn(2, 4), RNG.randn(2, 3)
    grads = _step_gradients(tm, {"x": x}, target)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    prefix = "k16" if rate == 16000 else "k8"
    y = activation(torch.tensor(x) @ tensors[f"{prefix}.W"] + tensors[f"{prefix}.b"])
    torch.nn.functional.mse_loss(y, torch.tensor(target)).backward()
    for name, tensor in tensors.items():
        want = tensor.grad.numpy()
        np.testing.assert_allclose(grads[name], want, rtol=1e-12, atol=1e-14 * np.abs(want).max())


def test_branch_weights_are_selected_by_name():
    model = _branch_weights_model()
    with pytest.warns(PromotedConstantsWarning):
        frozen = bridge.to_training_onnx(model, constant_inputs={"sr": 16000}, frozen=["k16.b"])
        trained = bridge.to_training_onnx(model, constant_inputs={"sr": 16000}, trainable=["k16.b"])
    assert frozen.weights == ["k16.W"]
    assert trained.weights == ["k16.b"]


def test_exported_model_holds_the_trained_branch_weights(tmp_path):
    """export_inference writes the trained values into the branch's Constants (the If and the pin kept)."""
    with pytest.warns(PromotedConstantsWarning):
        tm = bridge.to_training_onnx(_branch_weights_model(), constant_inputs={"sr": 16000}, optim_options={"lr": 0.5})
    x = RNG.randn(2, 4)
    session = tm.session()
    session.step({"x": x}, RNG.randn(2, 3))
    want = session.evaluate({"x": x}, np.zeros((2, 3)))["output_y"]
    path = tm.export_inference(tmp_path / "trained.onnx", session.state)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-12)
