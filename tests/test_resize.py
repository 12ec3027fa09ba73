"""Resize / Upsample: forward vs onnxruntime over the ONNX mode grid, backward vs torch's
F.interpolate for every mode that torch exports (float64, rtol 1e-9)."""
from __future__ import annotations

import io
import itertools

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import assert_importer_matches_onnxruntime
from helpers.single_op import batches_for, one_node_model, train_and_compare
from helpers.training import assert_trains_like

import bridge

rng = np.random.default_rng(5)
SHAPE = (2, 3, 4, 5)


def _resize_model(shape, opset, scales=None, sizes=None, dtype=np.float32, prescale=False, **attrs) -> onnx.ModelProto:
    inits = {}
    if scales is not None:
        inits["scales"] = np.asarray(scales, np.float32)
    if sizes is not None:
        inits["sizes"] = np.asarray(sizes, np.int64)
    if opset < 11:
        node_inputs = ["x", "scales"]
    else:
        node_inputs = ["x", "", "scales" if scales is not None else "", "sizes" if sizes is not None else ""]
        while not node_inputs[-1]:
            node_inputs.pop()
    pre = rng.standard_normal(shape).astype(dtype) if prescale else None
    return one_node_model("Resize", node_inputs, {"x": np.zeros(shape, dtype)}, inits, opset, prescale=pre, **attrs)


def _forward_matches_onnxruntime(model: onnx.ModelProto, shape) -> None:
    x = rng.standard_normal(shape).astype(np.float32)
    assert_importer_matches_onnxruntime(model, {"x": x}, rtol=1e-5, atol=1e-5, training=True)


NEAREST = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
COORDS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]
RESIZES = [dict(scales=[1, 1, 2, 3]), dict(scales=[1, 1, 0.5, 0.6]), dict(scales=[1, 1, 1.5, 0.8]),
           dict(sizes=[2, 3, 7, 3]), dict(sizes=[2, 3, 1, 9])]


@pytest.mark.parametrize("resize", RESIZES, ids=lambda r: str(r))
@pytest.mark.parametrize("coord, nearest", list(itertools.product(COORDS, NEAREST)))
def test_nearest_forward_matches_onnxruntime(resize, coord, nearest):
    model = _resize_model(SHAPE, 13, mode="nearest", coordinate_transformation_mode=coord, nearest_mode=nearest, **resize)
    _forward_matches_onnxruntime(model, SHAPE)


@pytest.mark.parametrize("resize", RESIZES, ids=lambda r: str(r))
@pytest.mark.parametrize("coord", COORDS)
@pytest.mark.parametrize("mode, cubic", [("linear", {}), ("cubic", {}), ("cubic", {"cubic_coeff_a": -0.5, "exclude_outside": 1})])
def test_linear_cubic_forward_matches_onnxruntime(resize, coord, mode, cubic):
    model = _resize_model(SHAPE, 13, mode=mode, coordinate_transformation_mode=coord, **cubic, **resize)
    _forward_matches_onnxruntime(model, SHAPE)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("scales", [[1, 1, 2, 2], [1, 1, 3, 1.5], [1, 1, 0.5, 0.5]])
def test_resize10_and_upsample_forward_match_onnxruntime(mode, scales):
    _forward_matches_onnxruntime(_resize_model(SHAPE, 10, scales=scales, mode=mode), SHAPE)
    if min(scales) >= 1:  # Upsample only upsamples
        upsample = one_node_model("Upsample", ["x", "scales"], {"x": np.zeros(SHAPE, np.float32)},
                                  {"scales": np.asarray(scales, np.float32)}, 9, mode=mode)
        _forward_matches_onnxruntime(upsample, SHAPE)


@pytest.mark.parametrize("resize", [dict(scales=[1, 1, 2, 2], axes=None), dict(sizes=[8, 7], axes=[2, 3]),
                                    dict(sizes=[9, 9], axes=[2, 3], keep_aspect_ratio_policy="not_larger"),
                                    dict(sizes=[9, 9], axes=[3, 2], keep_aspect_ratio_policy="not_smaller")], ids=str)
def test_opset19_axes_aspect_ratio_and_symmetric_pixels_match_onnxruntime(resize):
    attrs = {k: v for k, v in resize.items() if v is not None and k not in ("scales", "sizes")}
    size_args = {k: resize[k] for k in ("scales", "sizes") if k in resize}
    for coord in ("half_pixel_symmetric", "half_pixel"):
        model = _resize_model(SHAPE, 19, mode="linear", coordinate_transformation_mode=coord, **size_args, **attrs)
        _forward_matches_onnxruntime(model, SHAPE)


# torch.nn.functional.interpolate arguments -> the equivalent ONNX attributes. (torch's exporter writes
# pytorch_half_pixel for align_corners=False, which maps an output of size 1 to input position 0
# where torch's kernel reads position (in - 1) / 2: half_pixel is the exact twin.)
TORCH_MODES = {
    "nearest": ({"mode": "nearest"}, {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
    "nearest-exact": ({"mode": "nearest-exact"},
                      {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_ceil"}),
    "bilinear": ({"mode": "bilinear", "align_corners": False},
                 {"mode": "linear", "coordinate_transformation_mode": "half_pixel"}),
    "bilinear_align_corners": ({"mode": "bilinear", "align_corners": True},
                               {"mode": "linear", "coordinate_transformation_mode": "align_corners"}),
    "bicubic": ({"mode": "bicubic", "align_corners": False},
                {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75}),
    "bicubic_align_corners": ({"mode": "bicubic", "align_corners": True},
                              {"mode": "cubic", "coordinate_transformation_mode": "align_corners", "cubic_coeff_a": -0.75}),
}


@pytest.mark.parametrize("out_hw", [(8, 10), (7, 3), (2, 2), (1, 6)], ids=str)
@pytest.mark.parametrize("name", TORCH_MODES)
def test_backward_matches_torch_interpolate(name, out_hw):
    torch_args, onnx_attrs = TORCH_MODES[name]
    model = _resize_model(SHAPE, 13, sizes=list(SHAPE[:2]) + list(out_hw), dtype=np.float64, prescale=True, **onnx_attrs)
    pre = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w_pre"))

    def twin(p, inputs):
        return F.interpolate(inputs["x"] * p["w_pre"], size=out_hw, **torch_args)

    out_shape = SHAPE[:2] + tuple(out_hw)
    train_and_compare(model, {"w_pre": pre}, twin, batches_for({"x": SHAPE}, out_shape, 2), steps_rtol=1e-9)


@pytest.mark.parametrize("mode, shape, size", [("linear", (2, 3, 5), (9,)), ("trilinear", (1, 2, 3, 4, 2), (5, 2, 4)),
                                               ("nearest", (1, 2, 3, 4, 2), (6, 8, 3))])
def test_1d_and_3d_backward_match_torch_interpolate(mode, shape, size):
    onnx_mode = "nearest" if mode == "nearest" else "linear"
    coord = "asymmetric" if mode == "nearest" else "pytorch_half_pixel"
    model = _resize_model(shape, 13, sizes=list(shape[:2]) + list(size), dtype=np.float64, prescale=True, mode=onnx_mode,
                          coordinate_transformation_mode=coord, nearest_mode="floor")
    pre = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w_pre"))
    align = {} if mode == "nearest" else {"align_corners": False}

    def twin(p, inputs):
        return F.interpolate(inputs["x"] * p["w_pre"], size=size, mode=mode, **align)

    train_and_compare(model, {"w_pre": pre}, twin, batches_for({"x": shape}, shape[:2] + size, 2), steps_rtol=1e-9)


@pytest.mark.parametrize("upsample", [torch.nn.Upsample(scale_factor=2, mode="nearest"),
                                      torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                      torch.nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True)], ids=repr)
@pytest.mark.parametrize("opset", [11, 17])
def test_torch_exported_upsampling_model_matches_torch(upsample, opset):
    torch.manual_seed(0)
    module = _upsampling_net(upsample)
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 2, 3, 4),), buffer, dynamo=False, opset_version=opset,
                      input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(onnx.load_from_string(buffer.getvalue()), loss="mse", optim="sgd", optim_options={"lr": 0.1})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    assert "Resize" not in {n.op_type for n in tm.model.graph.node}
    out_shape = tuple(module(torch.zeros(2, 2, 3, 4)).shape)
    batches = batches_for({"x": (2, 2, 3, 4)}, out_shape, 2, dtype=np.float32)
    assert_trains_like(tm, module, batches, F.mse_loss, torch.optim.SGD, {"lr": 0.1})


def _upsampling_net(upsample: torch.nn.Module) -> torch.nn.Module:
    """An element-wise trainable scale (a Mul in ONNX, named ``scale``) before the upsampling."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.randn(1, 2, 3, 4))
            self.up = upsample

        def forward(self, x):
            return self.up(x * self.scale)

    return Net()


def test_tf_crop_and_resize_is_an_error():
    model = _resize_model(SHAPE, 13, scales=[1, 1, 2, 2], mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
                          name="crop")
    with pytest.raises(bridge.BridgeError, match="Resize node 'crop'.*tf_crop_and_resize"):
        bridge.to_training_onnx(model)
