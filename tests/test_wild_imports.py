"""Files from other exporters that used to be refused for reasons that are not real limits: weights
stored as Constant nodes (paddle2onnx) and default-domain opsets above 22 (jax2onnx's default).
Checked against float64 finite differences of a hand-made initializer twin and against the same model
at an older opset."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from helpers.oracle import check_training_step, step_outputs
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import bridge
from bridge.errors import UnsupportedOpError
from bridge.pipeline.load import PromotedConstantsWarning

RNG = np.random.default_rng(0)
WEIGHTS = {"conv_w": RNG.standard_normal((3, 2, 3, 3)), "conv_b": RNG.standard_normal(3),
           "fc_w": RNG.standard_normal((27, 4)), "fc_b": RNG.standard_normal(4)}
X = RNG.standard_normal((2, 2, 5, 5)).astype(np.float32)


def _cnn(as_constants: bool, opset: int = 17, dtype=np.float32) -> onnx.ModelProto:
    """Conv -> Relu -> MaxPool -> Flatten -> MatMul + Add, weights as Constant nodes (paddle2onnx's way)
    or as initializers; a one-element Constant (an epsilon-like offset) in both."""
    weights = [nh.from_array(v.astype(dtype), k) for k, v in WEIGHTS.items()]
    eps = h.make_node("Constant", [], ["offset"], value=nh.from_array(np.array(0.5, dtype)))
    nodes = [eps, h.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1]),
             h.make_node("Add", ["c", "offset"], ["c1"]), h.make_node("Relu", ["c1"], ["r"]),
             h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
             h.make_node("Flatten", ["p"], ["f"]), h.make_node("MatMul", ["f", "fc_w"], ["m"]),
             h.make_node("Add", ["m", "fc_b"], ["y"])]
    if as_constants:
        nodes = [h.make_node("Constant", [], [w.name], value=w) for w in weights] + nodes
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = h.make_graph(nodes, "paddle_like", [h.make_tensor_value_info("x", elem, [2, 2, 5, 5])],
                         [h.make_tensor_value_info("y", elem, [2, 4])], [] if as_constants else weights)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def test_constant_node_weights_train_like_initializers():
    with pytest.warns(PromotedConstantsWarning, match="conv_w, conv_b, fc_w, fc_b"):
        result = check_training_step(_cnn(as_constants=True), {"x": X}, reference=_cnn(as_constants=False))
    assert sorted(result.weights) == sorted(WEIGHTS)
    assert result.failures() == []


def test_promoted_constants_can_be_frozen():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromotedConstantsWarning)
        tm = bridge.to_training_onnx(_cnn(as_constants=True), frozen=["conv_*"])
    assert sorted(tm.weights) == ["fc_b", "fc_w"]


def test_initializer_models_keep_their_constants_constant():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromotedConstantsWarning)
        tm = bridge.to_training_onnx(_cnn(as_constants=False))
    assert "offset" not in tm.weights and sorted(tm.weights) == sorted(WEIGHTS)


@pytest.mark.parametrize("opset", [23, 24, 25])
def test_newer_opsets_train_as_the_same_model_at_opset_21(opset):
    target = RNG.standard_normal((2, 4)).astype(np.float32)
    steps = [step_outputs(bridge.to_training_onnx(_cnn(False, o), optim="adam"), {"x": X}, target, {})
             for o in (21, opset)]
    assert steps[0].keys() == steps[1].keys()
    for key in steps[0]:
        np.testing.assert_array_equal(steps[1][key], steps[0][key], err_msg=key)


def test_an_op_changed_after_opset_22_is_refused_by_name():
    graph = h.make_graph([h.make_node("TopK", ["x", "k"], ["v", "i"], name="top")], "topk",
                         [h.make_tensor_value_info("x", T.FLOAT, [2, 5])],
                         [h.make_tensor_value_info("v", T.FLOAT, [2, 2]), h.make_tensor_value_info("i", T.INT64, [2, 2])],
                         [nh.from_array(np.array([2], np.int64), "k")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 24)])
    with pytest.raises(UnsupportedOpError, match=r"TopK-24 \(nodes: top\).*opset 22 or lower"):
        bridge.to_training_onnx(model)


def _filled_cnn(as_fills: bool) -> onnx.ModelProto:
    """The CNN with every weight one value repeated: ``ConstantOfShape`` of an int64 initializer
    shape (onnx's weight-stripped test models) or the same tensors as initializers."""
    filled = {k: np.full(v.shape, 0.1 * (i + 1), np.float32) for i, (k, v) in enumerate(WEIGHTS.items())}
    model = _cnn(as_constants=False)
    del model.graph.initializer[:]
    if not as_fills:
        model.graph.initializer.extend(nh.from_array(v, k) for k, v in filled.items())
        return model
    fills = [h.make_node("ConstantOfShape", [k + "__SHAPE"], [k], value=nh.from_array(np.array([v.flat[0]])))
             for k, v in filled.items()]
    model.graph.initializer.extend(nh.from_array(np.array(v.shape, np.int64), k + "__SHAPE") for k, v in filled.items())
    nodes = fills + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def test_constant_of_shape_weights_train_like_initializers():
    with pytest.warns(PromotedConstantsWarning, match="conv_w, conv_b, fc_w, fc_b"):
        result = check_training_step(_filled_cnn(as_fills=True), {"x": X}, reference=_filled_cnn(as_fills=False))
    assert sorted(result.weights) == sorted(WEIGHTS)
    assert result.failures() == []


def test_a_model_of_only_ai_onnx_ml_ops_is_refused_naming_them():
    """A model importing only ai.onnx.ml (as onnxmltools' do) with an op bridge has no converter for:
    the refusal names the op and why."""
    node = h.make_node("LinearRegressor", ["x"], ["y"], domain="ai.onnx.ml", coefficients=[1.0, 2.0], intercepts=[0.5])
    graph = h.make_graph([node], "linreg", [h.make_tensor_value_info("x", T.FLOAT, [3, 2])],
                         [h.make_tensor_value_info("y", T.FLOAT, [3, 1])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("ai.onnx.ml", 1)])
    with pytest.raises(UnsupportedOpError, match=r"ai\.onnx\.ml::LinearRegressor.*have no converter"):
        bridge.to_training_onnx(model)
