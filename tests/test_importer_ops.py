"""Forward semantics of the ONNX converters (elementwise, activations, reductions, shape ops):
each op alone in a model, run by bridge's importer and by onnxruntime on the same input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import assert_importer_matches_onnxruntime, import_and_run, run_onnxruntime
from helpers.single_op import one_node_model

import bridge

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4)).astype(np.float32)
POSITIVE = (np.abs(X) + 0.5).astype(np.float32)
UNIT = np.clip(X / 4, -0.9, 0.9).astype(np.float32)


def _check(op, feed, initializers=None, opset=18, out_dtype=None, **attrs):
    initializers = initializers or {}
    model = one_node_model(op, list(feed) + list(initializers), feed, initializers, opset, out_dtype=out_dtype, **attrs)
    assert_importer_matches_onnxruntime(model, feed, rtol=1e-5, atol=1e-6, what=op)


UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Neg", "Abs", "Floor", "Ceil", "Sign", "Sin", "Cos", "Erf",
         "Softplus", "Softsign", "HardSwish", "Mish", "Atan", "Sinh", "Cosh", "Asinh"]


@pytest.mark.parametrize("op", UNARY)
def test_unary(op):
    _check(op, {"x": X})


@pytest.mark.parametrize("op", ["Log", "Sqrt", "Reciprocal", "Acosh"])
def test_unary_positive(op):
    _check(op, {"x": (POSITIVE + 1).astype(np.float32)})


@pytest.mark.parametrize("op", ["Asin", "Acos", "Atanh"])
def test_unary_unit_interval(op):
    _check(op, {"x": UNIT})


@pytest.mark.parametrize("op, attrs", [
    ("LeakyRelu", {"alpha": 0.3}), ("Elu", {"alpha": 0.7}), ("Celu", {"alpha": 1.3}), ("Selu", {}),
    ("ThresholdedRelu", {"alpha": 0.2}), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
    ("Gelu", {}), ("Gelu", {"approximate": "tanh"}),
    ("Softmax", {"axis": 1}), ("LogSoftmax", {"axis": -1}), ("Hardmax", {"axis": 2}),
])
def test_activation_attributes(op, attrs):
    _check(op, {"x": X}, opset=20 if op == "Gelu" else 18, **attrs)


@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_opset_semantics(opset):
    """Before opset 13 Softmax flattens to 2-D at axis; from 13 it is per axis."""
    _check("Softmax", {"x": X}, opset=opset, axis=1)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"])
def test_binary_broadcast(op):
    other = (RNG.standard_normal((3, 1)) if op != "Pow" else np.full((3, 1), 2.0)).astype(np.float32)
    base = POSITIVE if op == "Pow" else X
    _check(op, {"x": base}, {"other": other})


@pytest.mark.parametrize("op", ["Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"])
def test_comparison(op):
    _check(op, {"x": np.round(X)}, {"other": np.zeros((4,), np.float32)}, out_dtype=np.bool_)


def test_integer_division_truncates():
    feed = {"x": np.array([-7, 7, -8, 9], np.int64)}
    _check("Div", feed, {"other": np.array([2, -2, 3, 4], np.int64)})


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reductions(op, keepdims):
    _check(op, {"x": X}, {"axes": np.array([1, -1], np.int64)}, keepdims=keepdims)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum"])
def test_reduction_axes_attribute_before_opset_18(op):
    opset = 11
    model = one_node_model(op, ["x"], {"x": X}, {}, opset, axes=[0, 2], keepdims=0)
    np.testing.assert_allclose(import_and_run(model, {"x": X})[0], run_onnxruntime(model, {"x": X})[0], rtol=1e-6)


REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]


@pytest.mark.parametrize("op", REDUCTIONS)
def test_reduction_noop_with_empty_axes_keeps_the_elementwise_part(op):
    """No axes + noop_with_empty_axes: no reduction, but ReduceL1 is |x|, ReduceLogSum log x ..."""
    _check(op, {"x": POSITIVE if op == "ReduceLogSum" else X}, {"axes": np.array([], np.int64)},
           noop_with_empty_axes=1)


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduction_with_empty_axes_reduces_every_axis(op, keepdims):
    _check(op, {"x": POSITIVE if op == "ReduceLogSum" else X}, {"axes": np.array([], np.int64)}, keepdims=keepdims)


@pytest.mark.parametrize("op", [op for op in REDUCTIONS if op != "ReduceMean"])
@pytest.mark.parametrize("axes", [[1], []])
def test_reduction_over_an_empty_axis_gives_the_identity(op, axes):
    """0 for sums, 1 for ReduceProd, -inf/+inf for ReduceMax/ReduceMin, -inf for the Log ones."""
    _check(op, {"x": np.zeros((2, 0, 4), np.float32)}, {"axes": np.array(axes, np.int64)})


def test_reduce_mean_over_an_empty_axis_is_nan():
    """0/0: NaN as the ONNX reference (numpy's mean) gives; onnxruntime returns 0 instead."""
    feed = {"x": np.zeros((2, 0, 4), np.float32)}
    model = one_node_model("ReduceMean", ["x", "axes"], feed, {"axes": np.array([1], np.int64)}, 18)
    assert np.isnan(import_and_run(model, feed)[0]).all()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32])
def test_cumsum_keeps_the_input_dtype(dtype):
    """torch.cumsum promotes int32 to int64; ONNX CumSum keeps the input's type."""
    from onnx import helper, numpy_helper

    x = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node("CumSum", ["x", "axis"], ["y"])], "cumsum",
                              [helper.make_tensor_value_info("x", elem, x.shape)],
                              [helper.make_tensor_value_info("y", elem, x.shape)],
                              [numpy_helper.from_array(np.array(1, np.int64), "axis")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got, want = import_and_run(model, {"x": x})[0], run_onnxruntime(model, {"x": x})[0]
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("equation, shapes", [
    ("bii->bi", [(2, 3, 3)]), ("...ii->...i", [(2, 2, 3, 3)]), ("ii", [(3, 3)]), ("ii->i", [(3, 3)]),
    ("bij,bjj->bi", [(2, 3, 4), (2, 4, 4)]), ("i...i->...", [(3, 2, 3)]), ("iij->ij", [(3, 3, 2)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ij,jk", [(2, 3), (3, 4)]),
])
def test_einsum_with_diagonals(equation, shapes):
    feed = {f"x{i}": RNG.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    _check("Einsum", feed, equation=equation)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_extremes(op, select_last_index):
    ties = np.array([[1, 3, 3, 0], [2, 2, 1, 2]], np.float32)
    _check(op, {"x": ties}, axis=1, keepdims=0, select_last_index=select_last_index, out_dtype=np.int64)


@pytest.mark.parametrize("op, inputs, attrs", [
    ("Transpose", {}, {"perm": [2, 0, 1]}),
    ("Flatten", {}, {"axis": 2}),
    ("Reshape", {"shape": np.array([0, -1], np.int64)}, {}),
    ("Unsqueeze", {"axes": np.array([0, -1], np.int64)}, {}),
    ("Expand", {"shape": np.array([2, 2, 3, 4], np.int64)}, {}),
    ("Tile", {"repeats": np.array([1, 2, 1], np.int64)}, {}),
    ("Slice", {"starts": np.array([0, 1], np.int64), "ends": np.array([2, 100], np.int64),
               "axes": np.array([1, 2], np.int64), "steps": np.array([1, 2], np.int64)}, {}),
    ("Slice", {"starts": np.array([-1], np.int64), "ends": np.array([-100], np.int64),
               "axes": np.array([2], np.int64), "steps": np.array([-2], np.int64)}, {}),
    ("Gather", {"indices": np.array([[2, 0], [1, 1]], np.int64)}, {"axis": 1}),
    ("Gather", {"indices": np.array([-1, 0], np.int64)}, {"axis": 2}),
    ("GatherElements", {"indices": np.zeros((2, 3, 4), np.int64)}, {"axis": 1}),
    ("Pad", {"pads": np.array([0, 1, 0, 0, 2, 1], np.int64), "value": np.array(1.5, np.float32)}, {}),
    ("Pad", {"pads": np.array([0, 1, 1, 0, 1, 2], np.int64)}, {"mode": "reflect"}),
    ("Pad", {"pads": np.array([0, 0, 1, 0, 0, 2], np.int64)}, {"mode": "edge"}),
    ("Trilu", {"k": np.array(1, np.int64)}, {"upper": 0}),
    ("CumSum", {"axis": np.array(1, np.int64)}, {}),
    ("CumSum", {"axis": np.array(2, np.int64)}, {"exclusive": 1, "reverse": 1}),
])
def test_shape_and_data_movement(op, inputs, attrs):
    _check(op, {"x": X}, inputs, **attrs)


def test_split_and_concat_round_trip():
    model = one_node_model("Split", ["x", "split"], {"x": X}, {"split": np.array([1, 3], np.int64)}, 18, outputs=2, axis=2)
    got, want = import_and_run(model, {"x": X}), run_onnxruntime(model, {"x": X})
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    _check("Concat", {"x": X}, {"other": np.ones((2, 1, 4), np.float32)}, axis=1)


def test_shape_ops_fold_before_the_model_runs():
    """Shape -> Gather -> Concat -> Reshape (the exporters' dynamic flatten) needs no traced ints."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "axes"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus_one"], ["target_shape"], axis=0),
        helper.make_node("Reshape", ["x", "target_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "W"], ["y"]),
    ]
    inits = {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64), "minus_one": np.array([-1], np.int64),
             "W": RNG.standard_normal((12, 2)).astype(np.float32)}
    graph = helper.make_graph(nodes, "dynamic_flatten", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
                              [onnx_tensor(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    tm = bridge.to_training_onnx(model, loss="mse")
    assert tm.weights == ["W"]
    x = RNG.standard_normal((5, 3, 4)).astype(np.float32)
    target = np.zeros((5, 2), np.float32)
    grad = tm.session().step({"x": x}, target)["grad_W"]
    weight = torch.tensor(inits["W"], requires_grad=True)
    F.mse_loss(torch.tensor(x).reshape(5, 12) @ weight, torch.tensor(target)).backward()
    np.testing.assert_allclose(grad, weight.grad.numpy(), rtol=1e-5, atol=1e-7)


def onnx_tensor(value, name):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(value), name)


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads, axes", [([1, 0, 2, 1, 0, 1], None), ([2, -1], [-1]), ([-1, 1, 1, -1], [1, 2])],
                         ids=["every-axis", "axes-crop-end", "crop-and-pad"])
def test_pad_modes_on_any_axis(mode, pads, axes):
    inputs = {"pads": np.array(pads, np.int64)}
    if axes is not None:
        inputs.update(value=np.array(0.0, np.float32), axes=np.array(axes, np.int64))
    _check("Pad", {"x": X}, inputs, opset=19, mode=mode)


@pytest.mark.parametrize("axis", [-1, -2, -3, 0, 3])
def test_flatten_negative_axis_counts_from_the_rank(axis):
    _check("Flatten", {"x": X}, axis=axis)


@pytest.mark.parametrize("starts, ends, steps", [([10], [-10], [-2]), ([2], [-100], [-3]), ([-1], [0], [-4])])
def test_slice_negative_steps_with_clamped_bounds(starts, ends, steps):
    inputs = {"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
              "axes": np.array([2], np.int64), "steps": np.array(steps, np.int64)}
    _check("Slice", {"x": X}, inputs)


@pytest.mark.parametrize("opset", [14, 15])
def test_batch_norm_training_mode_outputs_running_statistics(opset):
    """training_mode=1: batch statistics, and running_mean / running_var outputs (biased batch
    variance) as the ONNX spec and onnxruntime define them."""
    channels = X.shape[1]
    inits = {"s": RNG.standard_normal(channels).astype(np.float32), "b": RNG.standard_normal(channels).astype(np.float32),
             "m": RNG.standard_normal(channels).astype(np.float32), "v": (RNG.random(channels) + 0.5).astype(np.float32)}
    model = one_node_model("BatchNormalization", ["x", *inits], {"x": X}, inits, opset, outputs=3, momentum=0.7,
                           training_mode=1)
    got, want = import_and_run(model, {"x": X}), run_onnxruntime(model, {"x": X})
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
