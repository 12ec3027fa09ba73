"""Training through activations, unary math, reductions, Einsum diagonals and masked softmax.

Each op is one ONNX node behind a trainable ``Mul`` (``prescale``) or with trainable inputs;
bridge's SGD steps are compared with torch autograd + ``torch.optim.SGD`` on a twin written
with ``torch``/``torch.nn.functional`` (float64), and the first gradient with central finite
differences of bridge's own loss (float64). ``train_and_compare`` also asserts that
onnx-mlir's op table accepts every training graph.
"""
from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, random_batches, torch_steps
from helpers.single_op import batches_for, one_node_model, train_and_compare
from helpers.training import assert_trains_like
from onnx import helper, numpy_helper

import bridge
from bridge.pipeline.lowering.reduce import cumprod
from bridge.pipeline.lowering.softmax import softmax_backward

SHAPE = (2, 3, 4)
RTOL = 1e-9  # float64 on both sides: measured differences are below 1e-13
FD_RTOL = 1e-6  # central differences, eps 1e-6 in float64: truncation + rounding ~1e-9
RTOL32 = 1e-5  # float32 on both sides: measured differences ~1e-7
FD32_EPS, FD32_RTOL = 1e-3, 2e-3  # float32 central differences: rounding ~1e-7 / eps dominates
# onnxruntime's CPU kernels of these ops exist for float32 only: their tests run in float32
FLOAT32_ONLY = {"Erf", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Asin", "Acos", "Atanh", "Acosh"}
rng = np.random.default_rng(0)


def finite_difference_grad(tm: bridge.TrainingModel, weight: str, batch, eps: float = 1e-6) -> np.ndarray:
    """d loss / d ``weight`` at the initial state, by central differences of the training graph's loss."""
    inputs, target = batch
    session = tm.session()
    base = tm.initial_state()
    grad = np.zeros_like(base[weight])
    for index in np.ndindex(grad.shape):
        losses = []
        for sign in (1.0, -1.0):
            moved = base[weight].copy()
            moved[index] += sign * eps
            session.state = {**base, weight: moved}
            losses.append(float(session.step(inputs, target)["loss"]))
        grad[index] = (losses[0] - losses[1]) / (2 * eps)
    return grad


def assert_matches_finite_differences(tm: bridge.TrainingModel, got: list[dict], batch, float32: bool = False) -> None:
    eps, rtol = (FD32_EPS, FD32_RTOL) if float32 else (1e-6, FD_RTOL)
    for weight in tm.weights:
        want = finite_difference_grad(tm, weight, batch, eps)
        scale = float(np.max(np.abs(want)))
        np.testing.assert_allclose(got[0][f"grad_{weight}"], want, rtol=rtol, atol=rtol * scale + 1e-12, err_msg=weight)


def check_op(op: str, twin: Callable, data: np.ndarray, pre: np.ndarray, *, opset: int = 18, extra=None,
             lr: float = 0.125, steps: int = 3, out_shape=None, float32: bool = False, **attrs):
    """``op`` on ``x * w_pre`` (plus trainable ``extra`` inputs): SGD steps vs torch, then finite
    differences of the first gradient."""
    extra = extra or {}
    if float32:
        data, pre = data.astype(np.float32), pre.astype(np.float32)
    model = one_node_model(op, ["x", *extra], {"x": data}, extra, opset, prescale=pre, out_shape=out_shape, **attrs)
    out = twin(torch.tensor(data) * torch.tensor(pre), *(torch.tensor(v) for v in extra.values()))
    batches = [({"x": data * (1 + 0.1 * k)}, rng.standard_normal(tuple(out.shape)).astype(data.dtype))
               for k in range(steps)]

    def torch_twin(params, inputs):
        return twin(inputs["x"] * params["w_pre"], *(params[k] for k in extra))

    tm, got = train_and_compare(model, {"w_pre": pre, **extra}, torch_twin, batches, lr=lr,
                                steps_rtol=RTOL32 if float32 else RTOL)
    assert all(np.isfinite(v).all() for v in got[0].values())
    assert_matches_finite_differences(tm, got, batches[0], float32)
    return tm, got


# ---------------------------------------------------------------- activations

F32 = lambda value: float(np.float32(value))  # noqa: E731  ONNX float attributes are float32
SELU_ALPHA, SELU_GAMMA = F32(1.67326319217681884765625), F32(1.05070102214813232421875)
FAST_OPS = 4  # per sweep below, the cases make test-fast runs: the others are ``slow`` (tests/test_op_db.py
# trains every op in make test-fast against finite differences; these compare with torch)


def _thin(cases: list) -> list:
    """``cases`` as pytest params: the first ``FAST_OPS`` unmarked, the others ``slow``."""
    return [pytest.param(*case, marks=() if index < FAST_OPS else pytest.mark.slow) for index, case in enumerate(cases)]


ACTIVATIONS = [  # attribute values exact in float32 (torch's own defaults differ after 7 digits)
    ("Relu", {}, F.relu),
    ("LeakyRelu", {"alpha": 0.25}, lambda x: F.leaky_relu(x, 0.25)),
    ("LeakyRelu", {}, lambda x: F.leaky_relu(x, F32(0.01))),
    ("Elu", {"alpha": 0.75}, lambda x: F.elu(x, 0.75)),
    ("Elu", {}, F.elu),
    ("Celu", {"alpha": 1.25}, lambda x: F.celu(x, 1.25)),
    ("Selu", {}, lambda x: SELU_GAMMA * F.elu(x, SELU_ALPHA)),
    ("ThresholdedRelu", {"alpha": 0.5}, lambda x: F.threshold(x, 0.5, 0.0)),
    ("Sigmoid", {}, torch.sigmoid),
    ("HardSigmoid", {"alpha": 0.375, "beta": 0.625}, lambda x: torch.clamp(0.375 * x + 0.625, 0.0, 1.0)),
    ("HardSigmoid", {}, lambda x: torch.clamp(F32(0.2) * x + 0.5, 0.0, 1.0)),
    ("HardSwish", {}, F.hardswish),
    ("Tanh", {}, torch.tanh),
    ("Softplus", {}, F.softplus),
    ("Softsign", {}, F.softsign),
    ("Mish", {}, F.mish),
    ("Gelu", {}, F.gelu),
    ("Gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
]


@pytest.mark.parametrize("op, attrs, twin", _thin(ACTIVATIONS), ids=[f"{a[0]}-{a[1]}" for a in ACTIVATIONS])
def test_activation_trains(op, attrs, twin):
    data = rng.standard_normal(SHAPE) * 2
    exact_gelu = op == "Gelu" and not attrs
    check_op(op, twin, data, rng.standard_normal(SHAPE), opset=20 if op == "Gelu" else 18, float32=exact_gelu, **attrs)


@pytest.mark.parametrize("op, opset, axis, twin", [
    ("Softmax", 13, 1, lambda x: torch.softmax(x, 1)),
    ("Softmax", 11, 1, lambda x: torch.softmax(x.reshape(2, 12), 1).reshape(SHAPE)),  # 2-D coercion
    ("LogSoftmax", 13, -1, lambda x: torch.log_softmax(x, -1)),
    ("LogSoftmax", 11, 1, lambda x: torch.log_softmax(x.reshape(2, 12), 1).reshape(SHAPE)),
])
def test_softmax_family_trains(op, opset, axis, twin):
    check_op(op, twin, rng.standard_normal(SHAPE), rng.standard_normal(SHAPE), opset=opset, axis=axis)


def test_prelu_trains_input_and_slope():
    slope = np.array([[0.1], [0.25], [-0.3]])  # per channel (axis 1), as F.prelu

    def twin(x, s):
        return F.prelu(x, s.reshape(-1))

    check_op("PRelu", twin, rng.standard_normal(SHAPE), rng.standard_normal(SHAPE), extra={"slope": slope})


@pytest.mark.parametrize("op, twin", [("Elu", F.elu), ("Selu", ACTIVATIONS[6][2]), ("Celu", F.celu)])
def test_exponential_activations_have_finite_gradients_for_large_inputs(op, twin):
    """exp(1000) = inf in the branch ``where`` drops: its backward must not make 0 * inf = NaN."""
    data = np.where(rng.standard_normal(SHAPE) > 0, 1000.0, -3.0)
    model = one_node_model(op, ["x"], {"x": data}, {}, 18, prescale=np.ones(SHAPE))
    batches = [({"x": data}, rng.standard_normal(SHAPE))]
    train_and_compare(model, {"w_pre": np.ones(SHAPE)}, lambda p, i: twin(i["x"] * p["w_pre"]), batches,
                      steps_rtol=RTOL, lr=2.0 ** -12)


def _exported_mlp(activation: torch.nn.Module) -> tuple[torch.nn.Module, onnx.ModelProto]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 16), activation, torch.nn.Linear(16, 4))
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.randn(5, 6),), buffer, dynamo=False, input_names=["x"], output_names=["y"])
    return module, onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("activation", [torch.nn.LeakyReLU(0.2), torch.nn.ELU(0.8), torch.nn.CELU(1.5),
                                        torch.nn.SELU(), torch.nn.Hardswish()], ids=lambda m: type(m).__name__)
def test_torch_exported_mlp_with_activation_matches_torch(activation):
    """``nn.Linear -> activation -> nn.Linear`` from ``torch.onnx.export``: 3 SGD steps vs the module."""
    module, model = _exported_mlp(activation)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.05})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    batches = random_batches(tm, 3)
    assert_trains_like(tm, module, batches, F.mse_loss, torch.optim.SGD, {"lr": 0.05})  # float32 as torch's module


@pytest.mark.parametrize("activation, alpha", [("LeakyRelu", 0.25), ("Elu", 0.75)])
def test_rnn_with_activation_trains(activation, alpha):
    """ONNX RNN with a LeakyRelu/Elu cell activation vs the same recurrence in torch."""
    seq, batch, inp, hidden = 3, 2, 4, 5
    weights = {"W": rng.standard_normal((1, hidden, inp)) * 0.5, "R": rng.standard_normal((1, hidden, hidden)) * 0.5,
               "B": rng.standard_normal((1, 2 * hidden)) * 0.1}
    data = {"x": rng.standard_normal((seq, batch, inp))}
    model = one_node_model("RNN", ["x", "W", "R", "B"], data, weights, 14, out_shape=(seq, 1, batch, hidden),
                           hidden_size=hidden, activations=[activation], activation_alpha=[alpha])
    act = {"LeakyRelu": lambda h: F.leaky_relu(h, alpha), "Elu": lambda h: F.elu(h, alpha)}[activation]

    def twin(params, inputs):
        h = torch.zeros(batch, hidden, dtype=torch.float64)
        outs = []
        bias = params["B"][0, :hidden] + params["B"][0, hidden:]
        for x in inputs["x"]:
            h = act(x @ params["W"][0].T + h @ params["R"][0].T + bias)
            outs.append(h)
        return torch.stack(outs).unsqueeze(1)

    batches = batches_for({"x": (seq, batch, inp)}, (seq, 1, batch, hidden), 2)
    train_and_compare(model, weights, twin, batches, steps_rtol=RTOL)


# ---------------------------------------------------------------- unary math

def _uniform(low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, SHAPE)


UNARY = [  # op, torch twin, data, pre-scale: x * w_pre stays inside the op's domain while training
    ("Exp", torch.exp, None, None), ("Sin", torch.sin, None, None), ("Cos", torch.cos, None, None),
    ("Abs", torch.abs, None, None), ("Neg", torch.neg, None, None), ("Erf", torch.erf, None, None),
    ("Tan", torch.tan, (-1.0, 1.0), (0.5, 1.0)), ("Atan", torch.atan, None, None),
    ("Sinh", torch.sinh, None, None), ("Cosh", torch.cosh, None, None), ("Asinh", torch.asinh, None, None),
    ("Asin", torch.asin, (-0.8, 0.8), (0.5, 1.0)), ("Acos", torch.acos, (-0.8, 0.8), (0.5, 1.0)),
    ("Atanh", torch.atanh, (-0.8, 0.8), (0.5, 1.0)), ("Acosh", torch.acosh, (1.5, 3.0), (1.0, 1.5)),
    ("Log", torch.log, (0.5, 2.0), (0.5, 1.5)), ("Sqrt", torch.sqrt, (0.5, 2.0), (0.5, 1.5)),
    ("Reciprocal", torch.reciprocal, (0.5, 2.0), (0.5, 1.5)),
]


@pytest.mark.parametrize("op, twin, data, pre", _thin(UNARY), ids=[u[0] for u in UNARY])
def test_unary_math_trains(op, twin, data, pre):
    data = _uniform(*data) if data else rng.standard_normal(SHAPE)
    pre = _uniform(*pre) if pre else rng.standard_normal(SHAPE)
    check_op(op, twin, data, pre, lr=2.0 ** -8, steps=2, float32=op in FLOAT32_ONLY)


def test_pow_trains_base_and_exponent():
    exponent = np.array([[1.5], [2.0], [0.5]])
    check_op("Pow", torch.pow, _uniform(0.5, 2.0), _uniform(0.5, 1.5), extra={"e": exponent}, lr=2.0 ** -8)


# ---------------------------------------------------------------- reductions

def _with_zeros() -> np.ndarray:
    """Rows along axis 1 with no zero, one zero and two zeros: the three cases of prod's gradient."""
    data = rng.standard_normal(SHAPE)
    data[0, 1, 2] = 0.0
    data[1, 0, 3] = data[1, 2, 3] = 0.0
    return data


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_cumprod_lowering_matches_aten_with_zeros(dim):
    x = torch.tensor(_with_zeros())
    torch.testing.assert_close(cumprod(x, dim), torch.cumprod(x, dim), rtol=1e-15, atol=0)


@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([1, 2], 0)])
def test_reduce_prod_trains_through_zeros(axes, keepdims):
    def twin(x):
        for axis in sorted(axes, reverse=True):
            x = torch.prod(x, axis, keepdim=bool(keepdims))
        return x

    # opset 13: axes is an attribute (an input from 18 on, tested by test_importer_ops)
    _, got = check_op("ReduceProd", twin, _with_zeros(), rng.uniform(0.5, 1.5, SHAPE), opset=13,
                      keepdims=keepdims, axes=axes)
    assert np.count_nonzero(got[0]["grad_w_pre"]) < got[0]["grad_w_pre"].size  # the zeros' rows route


@pytest.mark.parametrize("op, fn", [("ReduceMax", torch.amax), ("ReduceMin", torch.amin)])
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([1, 2], 0), ([0, 1, 2], 1)])
def test_reduce_max_min_split_ties_as_torch_amax(op, fn, axes, keepdims):
    """Ties (equal x along the reduced axes, kept by a pre-scale constant along them) share the
    gradient evenly, as ``torch.amax``/``torch.amin`` autograd does; no Cast in the graph."""
    data = np.round(rng.standard_normal(SHAPE))  # values in {-3..3}: ties in most reduced slices
    data[:, 1, :] = data[:, 0, :]  # and duplicates along axis 1 everywhere
    pre = np.ones([1 if i in axes else s for i, s in enumerate(SHAPE)]) * rng.uniform(0.5, 1.5)
    model = one_node_model(op, ["x", "axes"], {"x": data}, {"axes": np.array(axes, np.int64)}, 18,
                           prescale=pre, keepdims=keepdims)
    out = fn(torch.tensor(data), dim=axes, keepdim=bool(keepdims))
    batches = [({"x": data}, rng.standard_normal(tuple(out.shape))) for _ in range(2)]

    def twin(params, inputs):
        return fn(inputs["x"] * params["w_pre"], dim=axes, keepdim=bool(keepdims))

    train_and_compare(model, {"w_pre": pre}, twin, batches, steps_rtol=RTOL)  # asserts: no int/bool Cast


def test_reduce_max_gradient_is_split_among_ties():
    """The split itself (independent of torch): 3 tied maxima get 1/3 of the gradient each."""
    data = np.array([[1.0, 3.0, 3.0, 2.0, 3.0]])
    model = one_node_model("ReduceMax", ["x", "axes"], {"x": data}, {"axes": np.array([1], np.int64)}, 18,
                           prescale=np.ones((1, 1)), keepdims=1)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd")
    out = tm.session().step({"x": data}, np.zeros((1, 1)))
    # d/dw of (max(x * w))^2 = 2 * 3w * 3 = 18 at w = 1, from the three tied x = 3
    np.testing.assert_allclose(out["grad_w_pre"], [[18.0]], rtol=1e-12)


# ---------------------------------------------------------------- Einsum with diagonals

@pytest.mark.parametrize("equation, shapes", [
    ("bii->bi", [(2, 3, 3)]),
    ("...ii->...i", [(2, 2, 3, 3)]),
    ("ii", [(3, 3)]),
    ("bij,bjj->bi", [(2, 3, 4), (2, 4, 4)]),
    ("iji->j", [(3, 2, 3)]),
])
def test_einsum_with_diagonal_trains(equation, shapes):
    """Repeated letters in an input (a diagonal) train: both operands are trainable."""
    data = rng.standard_normal(shapes[0])
    extra = {f"w{i}": rng.standard_normal(s) for i, s in enumerate(shapes[1:], 1)}

    def twin(*xs):
        return torch.einsum(equation, *xs)

    check_op("Einsum", twin, data, rng.standard_normal(shapes[0]), extra=extra, equation=equation)


# ---------------------------------------------------------------- masked softmax

def test_softmax_backward_lowering_matches_aten():
    x = torch.tensor(rng.standard_normal(SHAPE))
    grad = torch.tensor(rng.standard_normal(SHAPE))
    for dim in range(-1, 3):
        probs = torch.softmax(x, dim)
        want = torch.ops.aten._softmax_backward_data(grad, probs, dim, torch.float64)
        torch.testing.assert_close(softmax_backward(grad, probs, dim, torch.float64), want, rtol=1e-13, atol=1e-15)


TOKENS, DIM = 4, 3
MASKED_ROW = 1


def _attention_mask() -> np.ndarray:
    """Causal, plus query row ``MASKED_ROW`` masked entirely (-inf everywhere)."""
    mask = np.where(np.tril(np.ones((TOKENS, TOKENS))) > 0, 0.0, -np.inf)
    mask[MASKED_ROW] = -np.inf
    return mask


def _attention_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Single-head attention as HF exports it: softmax of masked scores, NaN -> 0 by Where(IsNaN)."""
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Add", ["s", "mask"], ["masked"], name="mask_add"),
        helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"], name="isnan"),
        helper.make_node("Where", ["nan", "zero", "p"], ["p0"], name="nan_to_zero"),
        helper.make_node("MatMul", ["p0", "v"], ["y"], name="out"),
    ]
    constants = {"mask": _attention_mask(), "zero": np.array(0.0)}
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, (2, TOKENS, DIM))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, (2, TOKENS, DIM))],
        [numpy_helper.from_array(v, k) for k, v in {**weights, **constants}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


def _attention(params, inputs, safe: bool) -> torch.Tensor:
    """The model in torch; ``safe``: the masked row's scores are replaced before the softmax, so
    torch's autograd has no NaN (the row's output is 0 either way)."""
    x = inputs["x"]
    scores = (x @ params["wq"]) @ (x @ params["wk"]).transpose(1, 2) + torch.tensor(_attention_mask())
    dead = torch.isinf(scores).all(-1, keepdim=True)
    if safe:
        scores = torch.where(dead, torch.zeros(()), scores)
    probs = torch.softmax(scores, -1)
    probs = torch.where(dead if safe else torch.isnan(probs), torch.zeros(()), probs)
    return probs @ (x @ params["wv"])


def test_fully_masked_attention_row_trains_with_finite_gradients():
    weights = {k: rng.standard_normal((DIM, DIM)) for k in ("wq", "wk", "wv")}
    model = _attention_model(weights)
    batches = batches_for({"x": (2, TOKENS, DIM)}, (2, TOKENS, DIM), 3)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125}, trainable=list(weights))
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    got = bridge_steps(tm, batches)
    assert all(np.isfinite(v).all() for step in got for v in step.values())
    # plain torch autograd: NaN for Q and K (the reason for the NaN-safe backward), V finite
    plain = torch_steps(lambda p, i: _attention(p, i, safe=False), weights, F.mse_loss, torch.optim.SGD,
                        {"lr": 0.125}, batches[:1])
    assert np.isnan(plain[0]["grad_wq"]).all() and np.isnan(plain[0]["grad_wk"]).all()
    np.testing.assert_allclose(got[0]["grad_wv"], plain[0]["grad_wv"], rtol=RTOL)
    np.testing.assert_allclose(got[0]["loss"], plain[0]["loss"], rtol=RTOL)
    # every step equals torch on the same model with the masked row kept out of the softmax
    want = torch_steps(lambda p, i: _attention(p, i, safe=True), weights, F.mse_loss, torch.optim.SGD,
                       {"lr": 0.125}, batches)
    assert_steps_match(got, want, rtol=RTOL)
