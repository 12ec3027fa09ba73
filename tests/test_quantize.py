"""Quantization (bridge/pipeline/importer/ops/quantize.py, docs/quantization.md): QDQ trains as torch's fake
quantization (straight-through rounding, saturation mask); the integer-only ops are refused
where a gradient would have to cross them."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import import_and_run, run_onnxruntime
from helpers.reference import assert_steps_match, bridge_steps, random_batches, torch_steps
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.errors import UnsupportedOpError

RNG = np.random.default_rng(0)
W = (2.0 * RNG.standard_normal((4, 3))).astype(np.float32)
ACT_SCALE, ACT_ZP = 0.01, 128  # activations: uint8 per tensor, saturating where |x @ W| > ~1.28
W_SCALES, W_ZPS = np.array([0.02, 0.03, 0.025], np.float32), np.array([0, 2, -3], np.int8)  # weights: int8 per column
LR = 0.1


def _model(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def qat_model() -> onnx.ModelProto:
    """x @ fake_quant_int8_per_column(W), then fake_quant_uint8 of the activation (QDQ pairs)."""
    nodes = [
        helper.make_node("QuantizeLinear", ["W", "w_scale", "w_zp"], ["Wq"], axis=1, name="quant_w"),
        helper.make_node("DequantizeLinear", ["Wq", "w_scale", "w_zp"], ["Wd"], axis=1, name="dequant_w"),
        helper.make_node("MatMul", ["x", "Wd"], ["h"], name="fc"),
        helper.make_node("QuantizeLinear", ["h", "a_scale", "a_zp"], ["hq"], name="quant_h"),
        helper.make_node("DequantizeLinear", ["hq", "a_scale", "a_zp"], ["y"], name="dequant_h"),
    ]
    return _model(nodes, {"W": W, "w_scale": W_SCALES, "w_zp": W_ZPS, "a_scale": np.float32(ACT_SCALE),
                          "a_zp": np.uint8(ACT_ZP)})


def torch_qat(params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    weight = torch.fake_quantize_per_channel_affine(params["W"], torch.tensor(W_SCALES), torch.tensor(W_ZPS, dtype=torch.int32),
                                                    1, -128, 127)
    return torch.fake_quantize_per_tensor_affine(inputs["x"] @ weight, ACT_SCALE, ACT_ZP, 0, 255)


def test_qdq_trains_like_torch_fake_quantization():
    tm = bridge.to_training_onnx(qat_model(), optim_options={"lr": LR})
    assert tm.weights == ["W"]  # scales are quantization parameters, not weights
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    batches = random_batches(tm, 3)
    want = torch_steps(torch_qat, {"W": W}, F.mse_loss, torch.optim.SGD, {"lr": LR}, batches)
    saturated = torch_qat({"W": torch.tensor(W)}, {"x": torch.tensor(batches[0][0]["x"])})
    assert {0.0, 255.0} <= set(np.round(saturated.numpy() / ACT_SCALE + ACT_ZP).ravel().tolist())  # both ends reached
    assert_steps_match(bridge_steps(tm, batches), want)


def test_quantize_rounds_half_to_even_and_saturates():
    x = np.array([[0.25, 0.75, 1.25, -0.25, -0.75, 1000.0, -1000.0]], np.float32)  # x / 0.5: ties, then saturation
    model = helper.make_model(helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["y"], name="q")], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, x.shape)],
        [numpy_helper.from_array(np.float32(0.5), "s"), numpy_helper.from_array(np.uint8(128), "zp")]),
        opset_imports=[helper.make_opsetid("", 17)])
    got, = import_and_run(model, {"x": x})
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, [[128, 130, 130, 128, 126, 255, 0]])
    np.testing.assert_array_equal(got, run_onnxruntime(model, {"x": x})[0])


def _integer_op_model(op: str) -> onnx.ModelProto:
    """A trainable MatMul in front of an integer-only op (DynamicQuantizeLinear or MatMulInteger)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc")]
    if op == "DynamicQuantizeLinear":
        nodes += [helper.make_node("DynamicQuantizeLinear", ["h"], ["hq", "s", "zp"], name="integer_op"),
                  helper.make_node("DequantizeLinear", ["hq", "s", "zp"], ["y"], name="dq")]
        inits = {"W": W}
    else:
        nodes += [helper.make_node("QuantizeLinear", ["h", "a_scale", "a_zp"], ["hq"], name="q"),
                  helper.make_node("MatMulInteger", ["hq", "B", "a_zp"], ["acc"], name="integer_op"),
                  helper.make_node("Cast", ["acc"], ["y"], to=TensorProto.FLOAT, name="to_float")]
        inits = {"W": W, "a_scale": np.float32(ACT_SCALE), "a_zp": np.uint8(ACT_ZP),
                 "B": RNG.integers(0, 255, (3, 3)).astype(np.uint8)}
    return _model(nodes, inits)


@pytest.mark.parametrize("op", ["DynamicQuantizeLinear", "MatMulInteger"])
def test_gradient_through_an_integer_only_op_is_refused(op):
    with pytest.raises(UnsupportedOpError, match=f"{op} node 'integer_op'.*integer arithmetic has no gradient.*QDQ"):
        bridge.to_training_onnx(_integer_op_model(op))


@pytest.mark.parametrize("op", ["DynamicQuantizeLinear", "MatMulInteger"])
def test_integer_only_op_imports_for_inference(op):
    model = _integer_op_model(op)
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    got, = import_and_run(model, {"x": x})
    np.testing.assert_array_equal(got, run_onnxruntime(model, {"x": x})[0])
