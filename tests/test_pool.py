"""Pooling: the lowerings eagerly against ATen (float64, ties included), the importer's pools
against onnxruntime, and training steps end to end against torch.nn.functional twins."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.cnn_checks import assert_forward_matches_onnxruntime, assert_onnx_mlir_clean, innermost_moves
from helpers.importer import run_onnxruntime
from helpers.reference import bridge_steps
from helpers.single_op import batches_for, one_node_model, train_and_compare
from onnx import TensorProto, helper
from torch.fx.experimental.proxy_tensor import make_fx

import bridge
import bridge.pipeline.importer.program
from bridge.errors import LoweringError, UnsupportedOpError
from bridge.pipeline.export.builder import GraphBuilder, Value
from bridge.pipeline.export.ops.nn import emit_max_pool
from bridge.pipeline.importer.program import OnnxProgram, relus_pooled_first
from bridge.pipeline.lowering import LOWERINGS, import_all_lowerings

import_all_lowerings()  # LOWERINGS is looked up directly below: register them also when this file runs alone

aten = torch.ops.aten
MAX_POOL = {2: (aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default),
            3: (aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default)}
AVG_POOL = {2: (aten.avg_pool2d.default, aten.avg_pool2d_backward.default),
            3: (aten.avg_pool3d.default, aten.avg_pool3d_backward.default)}
ADAPTIVE = {2: (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default),
            3: (aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default)}


def _close(got, want):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _max_cases():
    for rank, k, s, p, d, ceil, size in itertools.product((2, 3), (2, 3), (1, 2, 3), (0, 1), (1, 2), (False, True), (7, 8)):
        if rank == 3 and (size == 8 or d == 2):
            continue
        yield pytest.param(rank, k, s, p, d, ceil, size, id=f"{rank}d-k{k}-s{s}-p{p}-d{d}-{'ceil' if ceil else 'floor'}-L{size}")


@pytest.mark.parametrize("rank, k, s, p, d, ceil, size", list(_max_cases()))
def test_max_pool_backward_lowering_matches_aten(rank, k, s, p, d, ceil, size):
    """Inputs on a coarse grid (many ties): the first maximum of each window gets the gradient."""
    x = torch.round(torch.randn(2, 3, *[size] * rank, dtype=torch.float64) * 2) / 2
    forward, backward = MAX_POOL[rank]
    args = ([k] * rank, [s] * rank, [p] * rank, [d] * rank, ceil)
    y, indices = forward(x, *args)
    gy = torch.randn_like(y)
    _close(LOWERINGS[backward](gy, x, *args, indices), backward(gy, x, *args, indices))


def test_max_pool_backward_lowering_unbatched_and_1d_through_make_fx():
    """1-D pooling reaches the 2-D lowering through torch's own decomposition; unbatched input too."""
    from bridge.pipeline.lowering import decomposition_table

    for x, pool in ((torch.randn(2, 3, 11, dtype=torch.float64), lambda t: F.max_pool1d(t, 3, 2, 1, ceil_mode=True)),
                    (torch.randn(3, 7, 7, dtype=torch.float64), lambda t: F.max_pool2d(t, 2, 2, 1))):
        def grad(t):
            return torch.autograd.grad((pool(t) ** 2).sum(), t)[0]  # noqa: B023 (called within this iteration only)

        traced = make_fx(grad, decomposition_table=decomposition_table())(x.clone().requires_grad_())
        targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
        assert not any("backward" in str(t) for t in targets)
        _close(traced(x.clone().requires_grad_()), grad(x.clone().requires_grad_()))


@pytest.mark.parametrize("rank", [2, 3])
def test_tiled_max_pool_backward_is_arithmetic_and_routes_ties_to_the_first_max(rank):
    """Tiled windows (kernel == stride, no padding: ``MaxPool2d(2)``) take the full-resolution form
    (MaxPool, MatMul, Ceil, Relu: no Equal/Where, no scatter); every window all ties (a constant
    input), ties on a coarse grid with -inf elements (as an explicit -inf pad leaves), and sizes
    the windows do not cover still give torch's gradient: all of it to each window's first maximum."""
    forward, backward = MAX_POOL[rank]
    kernel, sizes = [2, 3, 2][-rank:], [5, 7, 5][-rank:]
    args = (kernel, kernel, [0] * rank, [1] * rank, False)
    coarse = torch.round(torch.randn(2, 3, *sizes, dtype=torch.float64) * 2) / 2
    coarse.view(-1)[::7] = float("-inf")
    for x in (torch.ones(2, 3, *sizes, dtype=torch.float64), coarse):
        y, indices = forward(x, *args)
        gy = torch.randn_like(y)
        _close(LOWERINGS[backward](gy, x, *args, indices), backward(gy, x, *args, indices))
    traced = make_fx(lambda g, t: LOWERINGS[backward](g, t, *args, indices))(gy, x)
    ops = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert {aten.mm.default, aten.ceil.default, forward} <= ops
    assert not ops & {aten.eq.Tensor, aten.where.self, aten.logical_xor.default}


def test_overlapping_max_pool_backward_moves_whole_channel_vectors():
    """resnet18's max pool (3x3, stride 2, padding 1) runs channels-last: its window slices, the
    routing and the col2im copy channel vectors, never 1-2 elements at a time."""
    forward, backward = MAX_POOL[2]
    args = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    x = torch.round(torch.randn(2, 8, 16, 16, dtype=torch.float64) * 2) / 2
    y, indices = forward(x, *args)
    gy = torch.randn_like(y)
    graph = make_fx(lambda g, t: LOWERINGS[backward](g, t, *args, indices))(gy, x)
    _close(graph(gy, x), backward(gy, x, *args, indices))
    assert not innermost_moves(graph)


def _avg_cases():
    """The sweep; ``make test-fast`` runs kernel 3 at size 7 (a divisor at stride 2), the rest is ``slow``."""
    for rank, k, s, p, ceil, include, size, divisor in itertools.product(
        (2, 3), (2, 3), (1, 2, 3), (0, 1), (False, True), (False, True), (7, 8), (None, 5)
    ):
        if rank == 3 and (size == 8 or divisor):
            continue
        fast = k == 3 and size == 7 and (divisor is None or s == 2)
        yield pytest.param(rank, k, s, p, ceil, include, size, divisor, marks=() if fast else pytest.mark.slow,
                           id=f"{rank}d-k{k}-s{s}-p{p}-{'ceil' if ceil else 'floor'}-{'incl' if include else 'excl'}-L{size}-div{divisor}")


@pytest.mark.parametrize("rank, k, s, p, ceil, include, size, divisor", list(_avg_cases()))
def test_avg_pool_lowerings_match_aten(rank, k, s, p, ceil, include, size, divisor):
    x = torch.randn(2, 3, *[size] * rank, dtype=torch.float64)
    forward, backward = AVG_POOL[rank]
    args = ([k] * rank, [s] * rank, [p] * rank, ceil, include, divisor)
    y = forward(x, *args)
    lowered = LOWERINGS[forward](x, *args)
    if lowered is NotImplemented:  # left to AveragePool: only when ONNX's AveragePool means the same
        assert divisor is None
    else:
        _close(lowered, y)
    gy = torch.randn_like(y)
    _close(LOWERINGS[backward](gy, x, *args), backward(gy, x, *args))


@pytest.mark.parametrize("rank, size, out", [(2, 7, [3, 3]), (2, 8, [3, 5]), (2, 4, [7, 4]), (2, 6, [1, 1]),
                                              (3, 7, [2, 3, 4]), (3, 5, [5, 1, 2])])
def test_adaptive_avg_pool_lowerings_match_aten(rank, size, out):
    x = torch.randn(2, 3, *[size] * rank, dtype=torch.float64)
    forward, backward = ADAPTIVE[rank]
    y = forward(x, out)
    _close(LOWERINGS[forward](x, out), y)
    gy = torch.randn_like(y)
    _close(LOWERINGS[backward](gy, x), backward(gy, x))


def test_max_pool_emitter_refuses_a_used_indices_output():
    traced = make_fx(lambda x: aten.max_pool2d_with_indices.default(x, [2, 2])[1] + 1)(torch.randn(1, 1, 4, 4))
    node = next(n for n in traced.graph.nodes if n.target is aten.max_pool2d_with_indices.default)
    with pytest.raises(LoweringError, match="Indices"):
        emit_max_pool(GraphBuilder(), node, Value("x", (1, 1, 4, 4), torch.float32), [2, 2])


# -- importer: ONNX semantics vs onnxruntime ----------------------------------------------------

MAX_POOL_ATTRS = {
    "2d-overlap-pads": ((2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "2d-asym-pads": ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[0, 1, 2, 0])),
    "2d-ceil": ((2, 3, 8, 9), dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1)),
    "2d-ceil-pads": ((2, 3, 8, 8), dict(kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1)),
    "2d-dilated": ((2, 3, 9, 9), dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[1, 2], pads=[1, 1, 1, 1])),
    "2d-same-upper": ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER")),
    "2d-same-lower": ((2, 3, 9, 8), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    "1d": ((2, 3, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    "3d": ((1, 2, 6, 5, 6), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[0, 1, 1, 0, 1, 0])),
    "2d-tiled": ((2, 3, 9, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),  # the last row is read by no window
    "3d-tiled": ((1, 2, 4, 6, 5), dict(kernel_shape=[2, 3, 2], strides=[2, 3, 2])),
}

AVG_POOL_ATTRS = {
    "2d-overlap-excl": ((2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "2d-overlap-incl": ((2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    "2d-asym-excl": ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[0, 1, 2, 0])),
    "2d-asym-incl": ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[0, 1, 2, 0], count_include_pad=1)),
    "2d-ceil": ((2, 3, 8, 9), dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1)),
    "2d-same-upper": ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER")),
    "1d": ((2, 3, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 1], count_include_pad=1)),
    "3d": ((1, 2, 6, 5, 6), dict(kernel_shape=[2, 3, 2], strides=[2, 1, 2], pads=[1, 1, 1, 1, 1, 1])),
    "2d-tiled": ((2, 3, 9, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
}

rng = np.random.default_rng(5)


def _pool_model(op_type, x_shape, attrs, opset=17):
    x = rng.standard_normal(x_shape).astype(np.float32)
    prescale = rng.choice([0.5, 1.0, 2.0], size=(1, x_shape[1]) + (1,) * (len(x_shape) - 2)).astype(np.float32)
    model = one_node_model(op_type, ["x"], {"x": x}, {}, opset, prescale=prescale, **attrs)
    return model, {"w_pre": prescale}, x


@pytest.mark.parametrize("case", MAX_POOL_ATTRS)
def test_max_pool_import_matches_onnxruntime(case):
    model, _, x = _pool_model("MaxPool", *MAX_POOL_ATTRS[case])
    assert_forward_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("opset", [8, 10, 12, 22])
def test_max_pool_import_across_opsets(opset):
    model, _, x = _pool_model("MaxPool", (2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 0, 1]),
                              opset=opset)
    assert_forward_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("case", AVG_POOL_ATTRS)
def test_avg_pool_import_matches_onnxruntime(case):
    model, _, x = _pool_model("AveragePool", *AVG_POOL_ATTRS[case])
    assert_forward_matches_onnxruntime(model, {"x": x})


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 5, 4), (1, 2, 3, 4, 3)], ids=["1d", "2d", "3d"])
def test_global_pool_import_matches_onnxruntime(op_type, shape):
    model, _, x = _pool_model(op_type, shape, {})
    assert_forward_matches_onnxruntime(model, {"x": x})


def test_max_pool_indices_output_is_refused():
    node = helper.make_node("MaxPool", ["x"], ["y", "indices"], name="pool", kernel_shape=[2, 2])
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 3, 3]),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, [1, 1, 3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedOpError, match="Indices"):
        OnnxProgram(model).run({"x": torch.zeros(1, 1, 4, 4)}, {}, training=False)


# -- end to end: training steps vs torch twins --------------------------------------------------

def _torch_pads(attrs, rank, sizes, kernel):
    """ONNX (begins, ends) written out independently of bridge, including auto_pad SAME_*."""
    strides, dilations = attrs.get("strides", [1] * rank), attrs.get("dilations", [1] * rank)
    if attrs.get("auto_pad", "").startswith("SAME"):
        totals = [max(0, (-(-n // s) - 1) * s + d * (k - 1) + 1 - n) for n, k, s, d in zip(sizes, kernel, strides, dilations, strict=True)]
        begins = [t // 2 if attrs["auto_pad"] == "SAME_UPPER" else t - t // 2 for t in totals]
        return begins, [t - b for t, b in zip(totals, begins, strict=True)]
    pads = attrs.get("pads", [0] * 2 * rank)
    return pads[:rank], pads[rank:]


def _pad_list(begins, ends):
    pad = []
    for b, e in reversed(list(zip(begins, ends, strict=True))):
        pad += [b, e]
    return pad


def _max_pool_twin(x_shape, attrs, out_shape):
    rank = len(x_shape) - 2
    kernel = attrs["kernel_shape"]
    begins, ends = _torch_pads(attrs, rank, x_shape[2:], kernel)
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[rank]

    def twin(p, inputs):
        x = F.pad(inputs["x"] * p["w_pre"], _pad_list(begins, ends), value=float("-inf"))
        y = pool(x, kernel, attrs.get("strides", 1), 0, attrs.get("dilations", 1), ceil_mode=bool(attrs.get("ceil_mode")))
        return y[(slice(None), slice(None)) + tuple(slice(0, n) for n in out_shape[2:])]

    return twin


def _output_shape(model):
    """From onnxruntime (ONNX shape inference keeps ceil_mode windows that start in the padding)."""
    x = model.graph.input[0]
    shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    return run_onnxruntime(model, {x.name: np.zeros(shape, np.float32)})[0].shape


@pytest.mark.parametrize("case", MAX_POOL_ATTRS)
def test_max_pool_training_step_matches_torch(case):
    x_shape, attrs = MAX_POOL_ATTRS[case]
    model, weights, _ = _pool_model("MaxPool", x_shape, attrs)
    out_shape = _output_shape(model)
    batches = [({"x": np.round(x["x"] * 2) / 2}, t) for x, t in batches_for({"x": x_shape}, out_shape, 2, np.float32)]
    tm, _ = train_and_compare(model, weights, _max_pool_twin(x_shape, attrs, out_shape), batches, steps_rtol=1e-5)
    maxpools = [n for n in tm.model.graph.node if n.op_type == "MaxPool"]
    assert maxpools and all(len(n.output) == 1 for n in maxpools)
    assert_onnx_mlir_clean(tm.model)


def _relu_max_pool_model(case):
    """``MaxPool(Relu(x * w_pre))`` with ``MAX_POOL_ATTRS[case]``."""
    x_shape, attrs = MAX_POOL_ATTRS[case]
    model, weights, _ = _pool_model("MaxPool", x_shape, attrs)
    model.graph.node.insert(1, helper.make_node("Relu", ["pre"], ["act"], name="act"))
    model.graph.node[2].input[0] = "act"
    del model.graph.value_info[:]
    return model, weights


@pytest.mark.parametrize("case", ["2d-overlap-pads", "2d-ceil-pads", "2d-dilated", "2d-tiled", "3d-tiled"])
def test_relu_before_max_pool_runs_after_it_with_the_same_step(case, monkeypatch):
    """``MaxPool(Relu(x))`` is traced as ``Relu(MaxPool(x))`` (``relus_pooled_first``): the Relu and its
    backward mask run on the pooled tensor. The steps match torch's relu-then-pool twin, and bit for bit
    the step traced in the source's order, on inputs on a grid of 0.5 (ties at the maximum, windows all
    <= 0 or all 0)."""
    x_shape, attrs = MAX_POOL_ATTRS[case]
    model, weights = _relu_max_pool_model(case)
    out_shape = _output_shape(model)
    batches = [({"x": np.round(x["x"] * 2) / 2}, t) for x, t in batches_for({"x": x_shape}, out_shape, 2, np.float32)]
    pool = _max_pool_twin(x_shape, attrs, out_shape)

    def twin(p, inputs):
        return pool({"w_pre": 1.0}, {"x": F.relu(inputs["x"] * p["w_pre"])})

    tm, got = train_and_compare(model, weights, twin, batches, steps_rtol=1e-5)
    forward = [n.op_type for n in bridge.ir.load(tm.model).nodes("forward") if n.op_type in ("Relu", "MaxPool")]
    assert forward.index("Relu") > forward.index("MaxPool")
    monkeypatch.setattr(bridge.pipeline.importer.program, "relus_pooled_first", lambda graph: {})
    in_order = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    forward = [n.op_type for n in bridge.ir.load(in_order.model).nodes("forward") if n.op_type in ("Relu", "MaxPool")]
    assert forward.index("Relu") < forward.index("MaxPool")
    for mine, theirs in zip(got, bridge_steps(in_order, batches), strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert np.array_equal(mine[key], theirs[key]), key


def test_relu_read_elsewhere_stays_before_its_max_pool():
    model, _ = _relu_max_pool_model("2d-tiled")
    assert list(relus_pooled_first(model.graph)) == ["act"]
    model.graph.output.append(helper.make_tensor_value_info("act", TensorProto.FLOAT, None))  # a graph output
    assert relus_pooled_first(model.graph) == {}
    model, _ = _relu_max_pool_model("2d-tiled")
    model.graph.node.append(helper.make_node("Neg", ["act"], ["negated"]))  # a second reader
    assert relus_pooled_first(model.graph) == {}
    model, _ = _relu_max_pool_model("2d-tiled")
    model.graph.node[2].output.append("indices")  # MaxPool's Indices
    assert relus_pooled_first(model.graph) == {}


def _avg_pool_twin(x_shape, attrs, out_shape):
    """Sum over the window of the zero-padded input, divided by ONNX's count."""
    rank = len(x_shape) - 2
    kernel = attrs["kernel_shape"]
    begins, ends = _torch_pads(attrs, rank, x_shape[2:], kernel)
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[rank]
    crop = (slice(None), slice(None)) + tuple(slice(0, n) for n in out_shape[2:])
    strides, ceil = attrs.get("strides", 1), bool(attrs.get("ceil_mode"))

    def window_sums(t):
        padded = F.pad(t, _pad_list(begins, ends))
        return (pool(padded, kernel, strides, 0, ceil_mode=ceil) * float(np.prod(kernel)))[crop]

    def twin(p, inputs):
        sums = window_sums(inputs["x"] * p["w_pre"])
        if attrs.get("count_include_pad"):
            return sums / float(np.prod(kernel))
        return sums / window_sums(torch.ones((1, 1) + tuple(x_shape[2:]), dtype=sums.dtype))

    return twin


@pytest.mark.parametrize("case", [c for c in AVG_POOL_ATTRS if c != "2d-ceil"])
def test_avg_pool_training_step_matches_torch(case):
    x_shape, attrs = AVG_POOL_ATTRS[case]
    model, weights, _ = _pool_model("AveragePool", x_shape, attrs)
    out_shape = _output_shape(model)
    batches = batches_for({"x": x_shape}, out_shape, 2, np.float32)
    tm, _ = train_and_compare(model, weights, _avg_pool_twin(x_shape, attrs, out_shape), batches, steps_rtol=1e-5)
    assert_onnx_mlir_clean(tm.model)


@pytest.mark.parametrize("count_include_pad", [False, True])
def test_ceil_mode_avg_pool_training_step_matches_torch(count_include_pad):
    """torch's own ceil_mode divisor (the last window is clipped to the padded input)."""
    x_shape = (2, 3, 8, 9)
    attrs = dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0], ceil_mode=1,
                 count_include_pad=int(count_include_pad))
    model, weights, _ = _pool_model("AveragePool", x_shape, attrs)
    batches = batches_for({"x": x_shape}, _output_shape(model), 2, np.float32)

    def twin(p, inputs):
        return F.avg_pool2d(inputs["x"] * p["w_pre"], [3, 2], [2, 2], [1, 0], ceil_mode=True,
                            count_include_pad=count_include_pad)

    tm, _ = train_and_compare(model, weights, twin, batches, steps_rtol=1e-5)
    assert_onnx_mlir_clean(tm.model)


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("shape", [(2, 3, 7), (2, 3, 5, 4), (1, 2, 3, 4, 3)], ids=["1d", "2d", "3d"])
def test_global_pool_training_step_matches_torch(op_type, shape):
    model, weights, _ = _pool_model(op_type, shape, {})
    dims = tuple(range(2, len(shape)))
    max_pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[len(dims)]

    def twin(p, inputs):
        x = inputs["x"] * p["w_pre"]
        return x.mean(dim=dims, keepdim=True) if op_type == "GlobalAveragePool" else max_pool(x, shape[2:])

    batches = batches_for({"x": shape}, _output_shape(model), 2, np.float32)
    tm, _ = train_and_compare(model, weights, twin, batches, steps_rtol=1e-5)
    assert_onnx_mlir_clean(tm.model)
