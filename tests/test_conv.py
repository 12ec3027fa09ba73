"""Convolution: the lowerings eagerly against ATen's own backward (float64), the importer's
Conv/ConvTranspose against onnxruntime, and training steps end to end against torch twins
written with torch.nn.functional (float32: onnxruntime's Conv has no double kernel)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cnn_checks import assert_forward_matches_onnxruntime, assert_onnx_mlir_clean, innermost_moves
from helpers.reference import random_batches
from helpers.single_op import batches_for, one_node_model, train_and_compare
from helpers.training import assert_trains_like, module_weights

import bridge
from bridge.pipeline import targets
from bridge.pipeline.lowering import conv as lowering

aten = torch.ops.aten
ALL = [True, True, True]


def _conv_cases():
    for rank, stride, padding, dilation, groups, size in itertools.product(
        (1, 2, 3), (1, 2, 3), (0, 1, 2), (1, 2), (1, 2, 4), (7, 8)
    ):
        if rank == 3 and (size == 8 or groups == 2):
            continue
        yield pytest.param(rank, stride, padding, dilation, groups, size,
                           id=f"{rank}d-s{stride}-p{padding}-d{dilation}-g{groups}-L{size}")


def _close(got, want):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rank, stride, padding, dilation, groups, size", list(_conv_cases()))
def test_convolution_backward_lowering_matches_aten(rank, stride, padding, dilation, groups, size):
    """Sizes 7 and 8 with strides 2/3 make the forward output floor: grad_input keeps x's shape."""
    x = torch.randn(2, 4, *[size] * rank, dtype=torch.float64)
    w = torch.randn(8, 4 // groups, *[3] * rank, dtype=torch.float64)
    args = ([stride] * rank, [padding] * rank, [dilation] * rank, False, [0] * rank, groups)
    gy = torch.randn_like(aten.convolution(x, w, None, *args))
    want = aten.convolution_backward(gy, x, w, [8], *args, ALL)
    got = lowering.convolution_backward(gy, x, w, [8], *args, ALL)
    for g, r in zip(got, want, strict=True):
        _close(g, r)


def _form_cases():
    """Every form on groups 1 (the only groups the im2col forms serve), floor/pad/dilation mixes."""
    for rank, stride, padding, dilation, size in itertools.product((1, 2, 3), (1, 2, 3), (0, 2), (1, 2), (7, 8)):
        if rank > 1 and size == 8 or rank == 3 and dilation == 2:  # floors: covered in 1-D (CI budget)
            continue
        yield pytest.param(rank, stride, padding, dilation, size, id=f"{rank}d-s{stride}-p{padding}-d{dilation}-L{size}")


INPUT_GRAD_FORMS = ("conv", "gemm", "gemm_offsets", "gemm_select")
WEIGHT_GRAD_FORMS = ("conv", "gemm", "gemm_channel_first", "gather", "gather_offsets")


@pytest.mark.parametrize("target", ["onnxruntime", "plain"])
@pytest.mark.parametrize("rank, stride, padding, dilation, size", list(_form_cases()))
def test_every_backward_form_matches_aten(rank, stride, padding, dilation, size, target):
    """Each input- and weight-gradient form, whatever the rule would pick for this shape, with the
    target's moves (constant 0/1 MatMuls or Pads and a flip); an asymmetric kernel, and a stride past
    the kernel (some input positions read by no window)."""
    x = torch.randn(2, 3, *[size] * rank, dtype=torch.float64)
    w = torch.randn(5, 3, *([3, 2, 1][:rank]), dtype=torch.float64)
    args = ([stride] * rank, [padding] * rank, [dilation] * rank)
    gy = torch.randn_like(aten.convolution(x, w, None, *args, False, [0] * rank, 1))
    want_x, want_w, _ = aten.convolution_backward(gy, x, w, None, *args, False, [0] * rank, 1, [True, True, False])
    with targets.using(target):
        for form in INPUT_GRAD_FORMS:
            _close(lowering.input_grad(gy, w, x.shape[2:], *args, 1, form=form), want_x)
        for form in WEIGHT_GRAD_FORMS:
            _close(lowering.weight_grad(gy, x, w.shape, *args, 1, form=form), want_w)


@pytest.mark.parametrize("product", ["weight_rows", "rows_matmul", "rows_gemm"])
@pytest.mark.parametrize("rank, stride, padding, dilation, size", list(_form_cases()))
def test_forward_gemm_matches_aten(rank, stride, padding, dilation, size, product, monkeypatch):
    """The forward's ``gemm`` form (one MatMul over the batch's columns) with bias, whatever the
    rule would pick, in each orientation of its product: floors, padding, dilation, an asymmetric kernel,
    a stride past the kernel; its columns by strided slices (5 output channels) and, where ``8 * L <= Cout``
    (weight rows only), by a selection MatMul."""
    monkeypatch.setattr(targets, "conv_forward_form", lambda *args: "gemm")
    monkeypatch.setattr(targets, "conv_forward_product", lambda *args: product)
    x = torch.randn(2, 3, *[size] * rank, dtype=torch.float64)
    args = ([stride] * rank, [padding] * rank, [dilation] * rank, False, [0] * rank, 1)
    for out_channels in sorted({5, 8 * size ** rank if rank < 3 else 5}):
        w = torch.randn(out_channels, 3, *([3, 2, 1][:rank]), dtype=torch.float64)
        b = torch.randn(out_channels, dtype=torch.float64)
        _close(lowering.lower_convolution(x, w, b, *args), aten.convolution(x, w, b, *args))


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("rank, stride, padding, dilation, size", list(_form_cases()))
def test_columns_in_parts_match_aten(rank, stride, padding, dilation, size, parts, monkeypatch):
    """``conv_columns_in_parts`` (the onnx-mlir target) with the columns cut into ``parts``, whatever its rule would
    cut: the forward per range of output positions, in both orientations of its row product and with bias (fewer
    positions than parts: one range each), and the weight gradient per group of kernel offsets (``gather_parts``)."""
    monkeypatch.setattr(targets, "conv_forward_form", lambda *args: "gemm")
    monkeypatch.setattr(targets, "column_parts", lambda *args: parts)
    x = torch.randn(2, 3, *[size] * rank, dtype=torch.float64)
    w = torch.randn(5, 3, *([3, 2, 1][:rank]), dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64)
    args = ([stride] * rank, [padding] * rank, [dilation] * rank)
    y = aten.convolution(x, w, b, *args, False, [0] * rank, 1)
    gy = torch.randn_like(y)
    want_w = aten.convolution_backward(gy, x, w, None, *args, False, [0] * rank, 1, [False, True, False])[1]
    with targets.using("onnx-mlir"):
        for product in ("rows_matmul", "rows_gemm"):
            monkeypatch.setattr(targets, "conv_forward_product", lambda *args, product=product: product)
            _close(lowering.lower_convolution(x, w, b, *args, False, [0] * rank, 1), y)
        _close(lowering.weight_grad(gy, x, w.shape, *args, 1, form="gather_parts"), want_w)


@pytest.mark.parametrize("target", ["onnxruntime", "plain"])
def test_tiny_output_planes_train_like_torch(tmp_path, target):
    """3x3 Convs on 2x2 output planes (onnxruntime's forward there is one MatMul over the batch, its
    columns by slices, then by a selection MatMul), a symbolic batch: the steps are torch's."""
    x = torch.randn(3, 8, 4, 4)
    module = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, 2, 1), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, 1, 1),
                                 torch.nn.Flatten(), torch.nn.Linear(128, 5))
    path = tmp_path / "tiny_planes.onnx"
    torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(path), loss="ce", optim="sgd", optim_options={"lr": 0.01}, dynamic_batch=True,
                                 target=target)
    assert_onnx_mlir_clean(tm.model)
    batches = random_batches(tm, 2, classes=5, input_shapes={"x": [3, 8, 4, 4]})
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.SGD, {"lr": 0.01})


@pytest.mark.parametrize("target", ["onnxruntime", "plain"])
@pytest.mark.parametrize("form", ["conv", "gemm"])
def test_strided_input_grad_moves_no_innermost_axis_of_stride_elements(form, target):
    """A 3x3 stride-2 input gradient, traced: torch's numbers; with ``constant_matmul_moves``
    (onnxruntime) the zero insertion and the phase interleave of the last spatial dim are MatMuls with
    constant 0/1 matrices, the kernel's flip a MatMul, so no copy has a 1-2 element innermost axis."""
    x, w = torch.randn(2, 8, 16, 16, dtype=torch.float64), torch.randn(16, 8, 3, 3, dtype=torch.float64)
    args = ([2, 2], [1, 1], [1, 1])
    gy = torch.randn_like(aten.convolution(x, w, None, *args, False, [0, 0], 1))
    want = aten.convolution_backward(gy, x, w, None, *args, False, [0, 0], 1, [True, False, False])[0]
    with targets.using(target):
        graph = torch.fx.experimental.proxy_tensor.make_fx(
            lambda g, w: lowering.input_grad(g, w, [16, 16], *args, 1, form=form))(gy, w)
    _close(graph(gy, w), want)
    if targets.TARGETS[target] >= {"constant_matmul_moves"}:
        assert not innermost_moves(graph)


@pytest.mark.parametrize("size, kernel, stride, padding", [(4, 1, 1, 0), (4, 2, 2, 0), (4, 1, 1, 1), (4, 2, 1, 0),
                                                          (1, 1, 1, 0), (3, 3, 1, 0)],
                         ids=["1x1", "windows-tile-the-input", "1x1-padded", "overlapping", "1x1-plane", "one-window"])
def test_select_input_grad_where_each_window_reads_its_own_positions(size, kernel, stride, padding):
    """``gemm_select`` where the scatter matrix may be the identity (a 1x1 kernel at stride 1, windows tiling the
    input: no MatMul needed) and where it is not, on output planes of one position (a squeeze-excitation Conv)
    and more: torch's numbers, traced as the conversion traces it."""
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    w = torch.randn(5, 3, kernel, kernel, dtype=torch.float64)
    args = ([stride] * 2, [padding] * 2, [1, 1])
    gy = torch.randn_like(aten.convolution(x, w, None, *args, False, [0, 0], 1))
    want = aten.convolution_backward(gy, x, w, None, *args, False, [0, 0], 1, [True, False, False])[0]
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda g, w: lowering.input_grad(g, w, [size, size], *args, 1, form="gemm_select"))(gy, w)
    _close(graph(gy, w), want)


def test_input_grad_of_windows_reading_only_padding_is_zero():
    """A 1-wide input, 1x1 kernel, stride 2, padding 1: the one window that reads it is none."""
    x, w = torch.randn(2, 3, 1, 1, dtype=torch.float64), torch.randn(4, 3, 1, 1, dtype=torch.float64)
    args = ([2, 2], [1, 1], [1, 1])
    gy = torch.randn_like(aten.convolution(x, w, None, *args, False, [0, 0], 1))
    want = aten.convolution_backward(gy, x, w, None, *args, False, [0, 0], 1, [True, False, False])[0]
    _close(lowering.input_grad(gy, w, [1, 1], *args, 1, form="gemm"), want)


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, False], [False, False, True]])
def test_convolution_backward_honours_output_mask(mask):
    x, w = torch.randn(2, 3, 6, 6, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64)
    args = ([2, 1], [1, 0], [1, 2], False, [0, 0], 1)
    gy = torch.randn_like(aten.convolution(x, w, None, *args))
    got = lowering.convolution_backward(gy, x, w, [4], *args, mask)
    want = aten.convolution_backward(gy, x, w, [4], *args, ALL)
    for keep, g, r in zip(mask, got, want, strict=True):
        if keep:
            _close(g, r)
        else:
            assert g is None


@pytest.mark.parametrize("rank, stride, padding, dilation, groups, output_padding", [
    (rank, s, p, d, g, op)
    for rank, s, p, d, g, op in itertools.product((1, 2, 3), (1, 2, 3), (0, 1), (1, 2), (1, 2), (0, 1))
    if (op < s or op < d) and not (rank == 3 and g == 2)
])
def test_transposed_convolution_lowering_matches_aten(rank, stride, padding, dilation, groups, output_padding):
    """Forward as the input gradient of a Conv, backward with input/grad_output exchanged."""
    x = torch.randn(2, 4, *[4] * rank, dtype=torch.float64)
    w = torch.randn(4, 6 // groups, *[3] * rank, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    args = ([stride] * rank, [padding] * rank, [dilation] * rank, True, [output_padding] * rank, groups)
    y = aten.convolution(x, w, bias, *args)
    _close(lowering.lower_convolution(x, w, bias, *args), y)
    gy = torch.randn_like(y)
    want = aten.convolution_backward(gy, x, w, [6], *args, ALL)
    for g, r in zip(lowering.convolution_backward(gy, x, w, [6], *args, ALL), want, strict=True):
        _close(g, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_lowering_constants_are_the_float64_arrays_rounded_as_a_cast_rounds_them(dtype):
    """The lowerings' constants (0/1 matrices, max pooling's tie-break priorities) hold what torch's cast of
    the float64 array gives, whether converted before the trace or traced as a cast."""
    array = np.random.default_rng(0).standard_normal((5, 7)) / 3
    got = lowering.constant(array, torch.empty(0, dtype=dtype))
    assert got.dtype == dtype and torch.equal(got, torch.from_numpy(array).to(dtype))


def test_non_transposed_convolution_is_left_to_the_emitter():
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    assert lowering.lower_convolution(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1) is NotImplemented


# -- importer: ONNX semantics (pads, auto_pad, output_shape) vs onnxruntime -------------------

CONV_ATTRS = {
    "2d-asym-pads": ((2, 3, 9, 8), (4, 3, 3, 3), dict(pads=[1, 0, 2, 1], strides=[2, 1])),
    "2d-same-upper": ((2, 3, 9, 8), (4, 3, 3, 2), dict(auto_pad="SAME_UPPER", strides=[2, 3])),
    "2d-same-lower": ((2, 3, 9, 8), (4, 3, 2, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    "2d-valid-dilated": ((2, 3, 9, 8), (4, 3, 3, 3), dict(auto_pad="VALID", dilations=[2, 1])),
    "2d-depthwise": ((2, 4, 7, 7), (4, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1], strides=[2, 2])),
    "2d-grouped": ((2, 4, 7, 7), (6, 2, 3, 3), dict(group=2, pads=[0, 1, 1, 0], dilations=[2, 2])),
    "1d": ((2, 3, 11), (4, 3, 4), dict(pads=[2, 1], strides=[3])),
    "3d": ((1, 2, 5, 6, 5), (3, 2, 2, 3, 2), dict(pads=[1, 0, 1, 0, 1, 0], strides=[2, 1, 2])),
}

CONV_TRANSPOSE_ATTRS = {
    "2d-stride-output-padding": ((2, 4, 4, 5), (4, 3, 3, 3), dict(strides=[2, 3], output_padding=[1, 2])),
    "2d-asym-pads": ((2, 4, 4, 5), (4, 3, 3, 3), dict(strides=[2, 2], pads=[1, 0, 0, 2])),
    "2d-groups-dilation": ((2, 4, 4, 5), (4, 2, 3, 2), dict(group=2, dilations=[2, 1], strides=[1, 2])),
    "2d-output-shape": ((2, 4, 4, 5), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[8, 10])),
    "2d-same-upper": ((2, 4, 4, 5), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    "1d": ((2, 4, 6), (4, 2, 3), dict(strides=[2], pads=[1, 1], output_padding=[1])),
    "3d": ((1, 2, 3, 3, 2), (2, 2, 2, 2, 2), dict(strides=[2, 1, 2], pads=[0, 1, 0, 0, 0, 1])),
}

rng = np.random.default_rng(3)


def _conv_model(op_type, x_shape, w_shape, attrs, bias=True):
    out_channels = w_shape[1] * attrs.get("group", 1) if op_type == "ConvTranspose" else w_shape[0]
    weights = {"W": rng.standard_normal(w_shape).astype(np.float32)}
    if bias:
        weights["B"] = rng.standard_normal(out_channels).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    model = one_node_model(op_type, ["x"] + list(weights), {"x": x}, weights, 17, **attrs)
    return model, weights, x


@pytest.mark.parametrize("case", CONV_ATTRS)
def test_conv_import_matches_onnxruntime(case):
    model, _, x = _conv_model("Conv", *CONV_ATTRS[case])
    assert_forward_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("case", CONV_TRANSPOSE_ATTRS)
def test_conv_transpose_import_matches_onnxruntime(case):
    model, _, x = _conv_model("ConvTranspose", *CONV_TRANSPOSE_ATTRS[case])
    assert_forward_matches_onnxruntime(model, {"x": x})


# -- end to end: training steps vs torch twins --------------------------------------------------

def _conv_twin(rank, attrs, x_shape, w_shape):
    """The ONNX Conv written independently: explicit F.pad, then F.convNd."""
    strides, dilations = attrs.get("strides", [1] * rank), attrs.get("dilations", [1] * rank)
    pads = attrs.get("pads", [0] * 2 * rank)
    if attrs.get("auto_pad", "").startswith("SAME"):  # output ceil(L / s); the odd pad at the end for UPPER
        totals = [max(0, (-(-size // s) - 1) * s + d * (k - 1) + 1 - size)
                  for size, k, s, d in zip(x_shape[2:], w_shape[2:], strides, dilations, strict=True)]
        begins = [t // 2 if attrs["auto_pad"] == "SAME_UPPER" else t - t // 2 for t in totals]
        pads = begins + [t - b for t, b in zip(totals, begins, strict=True)]
    torch_pads = []
    for i in reversed(range(rank)):
        torch_pads += [pads[i], pads[rank + i]]
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[rank]

    def twin(p, inputs):
        x = F.pad(inputs["x"], torch_pads)
        return conv(x, p["W"], p.get("B"), stride=strides, dilation=dilations, groups=attrs.get("group", 1))

    return twin


@pytest.mark.parametrize("case", CONV_ATTRS)
def test_conv_training_step_matches_torch(case):
    x_shape, w_shape, attrs = CONV_ATTRS[case]
    model, weights, _ = _conv_model("Conv", x_shape, w_shape, attrs, bias=case != "2d-grouped")
    out_shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
    batches = batches_for({"x": x_shape}, out_shape, 2, dtype=np.float32)
    twin = _conv_twin(len(x_shape) - 2, attrs, x_shape, w_shape)
    tm, _ = train_and_compare(model, weights, twin, batches, steps_rtol=1e-5)
    ops = {n.op_type for n in tm.model.graph.node}
    assert "ConvTranspose" not in ops
    assert_onnx_mlir_clean(tm.model)


def _conv_transpose_twin(rank, attrs, out_shape):
    conv_t = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[rank]
    pads = attrs.get("pads", [0] * 2 * rank)

    def twin(p, inputs):
        y = conv_t(inputs["x"], p["W"], p.get("B"), stride=attrs.get("strides", 1),
                   output_padding=attrs.get("output_padding", 0), groups=attrs.get("group", 1),
                   dilation=attrs.get("dilations", 1))
        index = [slice(None), slice(None)] + [slice(pads[i], y.shape[2 + i] - pads[rank + i]) for i in range(rank)]
        y = y[tuple(index)]
        if "output_shape" in attrs or attrs.get("auto_pad") == "SAME_UPPER":
            index = [slice(None), slice(None)]
            for i in range(rank):  # the odd element is cropped at the end for SAME_UPPER, else at the start
                total = y.shape[2 + i] - out_shape[2 + i]
                begin = total // 2 if attrs.get("auto_pad") == "SAME_UPPER" else total - total // 2
                index.append(slice(begin, begin + out_shape[2 + i]))
            y = y[tuple(index)]
        return y

    return twin


@pytest.mark.parametrize("case", CONV_TRANSPOSE_ATTRS)
def test_conv_transpose_training_step_matches_torch(case):
    """A trainable ConvTranspose: forward and backward must be Conv (W is not constant)."""
    x_shape, w_shape, attrs = CONV_TRANSPOSE_ATTRS[case]
    model, weights, _ = _conv_model("ConvTranspose", x_shape, w_shape, attrs)
    out_shape = tuple(d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim)
    batches = batches_for({"x": x_shape}, out_shape, 2, dtype=np.float32)
    tm, _ = train_and_compare(model, weights, _conv_transpose_twin(len(x_shape) - 2, attrs, out_shape),
                              batches, steps_rtol=1e-5)
    assert "ConvTranspose" not in {n.op_type for n in tm.model.graph.node}
    assert_onnx_mlir_clean(tm.model)


class TinyCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.conv2 = torch.nn.Conv2d(6, 8, 3, padding=1, groups=2)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.avg = torch.nn.AvgPool2d(2, ceil_mode=True)
        self.fc = torch.nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.avg(torch.relu(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("optim", ["sgd", "rmsprop"])
def test_torch_exported_cnn_matches_torch(tmp_path, optim):
    torch.manual_seed(0)
    module = TinyCNN()
    path = tmp_path / "cnn.onnx"
    torch.onnx.export(module, (torch.randn(2, 3, 13, 13),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(path), loss="ce", optim=optim, optim_options={"lr": 0.01})
    assert {"Conv", "MaxPool"} <= {n.op_type for n in tm.model.graph.node}
    assert_onnx_mlir_clean(tm.model)
    batches = random_batches(tm, 3, classes=5)
    assert set(tm.weights) == set(module_weights(module))
    optimizer = {"sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}[optim]
    assert_trains_like(tm, module, batches, F.cross_entropy, optimizer, {"lr": 0.01})


class WideCNN(torch.nn.Module):
    """Channels and sizes for which the onnxruntime rules pick every backward form."""

    SHAPES = [  # (Cin, Cout, kernel, stride, input size) of each Conv
        (3, 16, 3, 1, 10), (16, 16, 3, 1, 10), (16, 32, 3, 2, 10), (32, 64, 3, 2, 5), (64, 64, 3, 2, 3),
        (64, 64, 3, 1, 2), (64, 64, 1, 1, 2),
    ]

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(ci, co, k, stride=s, padding=k // 2)
                                         for ci, co, k, s, _ in self.SHAPES)
        self.fc = torch.nn.Linear(64 * 2 * 2, 5)

    def forward(self, x):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("weight_form, input_form", [
    *zip(WEIGHT_GRAD_FORMS, itertools.islice(itertools.cycle(INPUT_GRAD_FORMS), len(WEIGHT_GRAD_FORMS)), strict=True),
    (None, None)])
def test_every_backward_form_trains_like_torch(tmp_path, monkeypatch, weight_form, input_form):
    """Each im2col/col2im form given to every Conv (None: each Conv as the onnxruntime rules pick),
    through export, onnxruntime and onnx-mlir's table, vs torch."""
    if weight_form:
        monkeypatch.setattr(targets, "conv_weight_grad_form", lambda *args: weight_form)
        monkeypatch.setattr(targets, "conv_input_grad_form", lambda *args: input_form)
    torch.manual_seed(0)
    module = WideCNN()
    path = tmp_path / "wide.onnx"
    torch.onnx.export(module, (torch.randn(2, 3, 10, 10),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(path), loss="ce", optim="sgd", optim_options={"lr": 0.01})
    assert_onnx_mlir_clean(tm.model)
    batches = random_batches(tm, 2, classes=5)
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.SGD, {"lr": 0.01})


def test_offsets_reading_only_padding_make_no_empty_slices():
    """A 3x3 Conv, padding 1, on a 1x1 input: the corner offsets read
    padding only; they are dropped, not sliced to nothing (IREE rejects an empty Slice)."""
    x, w = torch.randn(2, 3, 1, 1, dtype=torch.float64), torch.randn(4, 3, 3, 3, dtype=torch.float64)
    args = ([1, 1], [1, 1], [1, 1])
    gy = torch.randn_like(aten.convolution(x, w, None, *args, False, [0, 0], 1))
    want = aten.convolution_backward(gy, x, w, None, *args, False, [0, 0], 1, [True, False, False])[0]
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda g, w: lowering.input_grad(g, w, [1, 1], *args, 1, form="gemm"))(gy, w)
    _close(graph(gy, w), want)
    pads = [n for n in graph.graph.nodes if n.target is aten.constant_pad_nd.default]
    assert pads
    for node in pads:  # the crop part of each pad (a Slice in ONNX) keeps every dim non-empty
        shape, pad = node.args[0].meta["val"].shape, node.args[1]
        for k in range(len(pad) // 2):
            assert shape[-1 - k] + min(pad[2 * k], 0) + min(pad[2 * k + 1], 0) > 0, node


@pytest.mark.iree
@pytest.mark.exhaustive
def test_every_backward_form_matches_onnxruntime_in_iree_at_a_symbolic_batch(tmp_path):
    """WideCNN's forms compiled by IREE with a symbolic batch (3 then 1): a channel-major col2im
    form was miscompiled there (gradients off by 100%) while onnxruntime was exact."""
    from helpers.reference import assert_steps_match, bridge_steps

    torch.manual_seed(0)
    path = tmp_path / "wide.onnx"
    torch.onnx.export(WideCNN(), (torch.randn(2, 3, 10, 10),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(path), loss="ce", optim="sgd", optim_options={"lr": 0.01}, dynamic_batch=True)
    rng = np.random.default_rng(0)
    batches = [({"x": rng.standard_normal((b, 3, 10, 10)).astype(np.float32)}, rng.integers(0, 5, b)) for b in (3, 1)]
    session = bridge.compile(tm).session(seed=0)
    assert_steps_match([session.step(inputs, target) for inputs, target in batches], bridge_steps(tm, batches))
