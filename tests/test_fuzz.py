"""Fuzzing (hypothesis, fixed seed): random small graphs, losses and optimizers, and mutated ONNX bytes.

Graph fuzz: a chain of supported ops (elementwise, broadcasting binary ops with a weight, MatMul,
Gemm with its attributes, Softmax, reductions, Transpose) over random shapes, in float32 or
float64, converted with a random loss and optimizer. Each example either

- matches the oracles: the loss equals torch.nn.functional's on ONNX's reference evaluator's
  forward; every gradient equals float64 central finite differences of that loss (within
  ``FD_NOISE_FACTOR`` times the measured finite-difference noise; a float32 graph within its
  float32 bound, see ``tests/helpers/oracle.py``); the update equals torch.optim's step on that
  gradient (float64 graphs); or
- raises a ``bridge.BridgeError``,

never a wrong gradient and never another exception. Loader fuzz: mutated bytes of a valid model
either load or raise ``ModelLoadError``. CI runs ``CI_EXAMPLES`` graphs and ``CI_LOADER_EXAMPLES``
byte mutations (the counts are printed in the terminal summary, also under pytest-xdist); the
exhaustive tier runs ``LONG_EXAMPLES`` of each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.oracle import (
    FD_NOISE_FACTOR,
    FLOAT32_EPS,
    FLOAT32_ULPS,
    FLOAT64_FLOOR,
    LR,
    REFERENCE_OPS,
    TORCH_NOISE_FACTOR,
    as_float64,
    run_reference,
    weights_as_inputs,
)
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.pipeline.load import load_model
from bridge.tools.verify import scale_of

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "models" / "mlp.onnx"
CI_EXAMPLES = 6
CI_LOADER_EXAMPLES = 40
LONG_EXAMPLES = 300
SEED = 20261130
UPDATE_ULPS = 64  # float64 units of roundoff between bridge's optimizer rule and torch.optim's step

UNARY = ("Tanh", "Sigmoid", "Softplus", "Neg", "Sin")
BINARY = ("Add", "Sub", "Mul", "Div")
LOSSES = ("mse", "smooth_l1", "huber", "ce", "bce_with_logits")
OPTIMIZERS = {
    "sgd": st.fixed_dictionaries({"lr": st.sampled_from([LR, LR / 16]), "momentum": st.sampled_from([0.0, 0.9]),
                                  "weight_decay": st.sampled_from([0.0, 0.01])}),
    "adam": st.fixed_dictionaries({"lr": st.just(LR / 16), "amsgrad": st.booleans(),
                                   "weight_decay": st.sampled_from([0.0, 0.01])}),
    "adamw": st.fixed_dictionaries({"lr": st.just(LR / 16)}),
    "rmsprop": st.fixed_dictionaries({"lr": st.just(LR / 16), "centered": st.booleans(),
                                      "momentum": st.sampled_from([0.0, 0.5])}),
    "adagrad": st.fixed_dictionaries({"lr": st.just(LR)}),
}


@dataclass
class Graph:
    """A chain of ONNX nodes built op by op, tracking the current value's shape."""

    dtype: int
    start: list[int]  # the input's shape
    shape: list[int]  # the current value's shape
    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    current: str = "x"
    names: int = 0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def fresh(self, prefix: str) -> str:
        """A new value name (initializers and node outputs share one counter)."""
        self.names += 1
        return f"{prefix}{self.names}"

    def weight(self, shape: list[int], positive: bool = False) -> str:
        value = self.rng.standard_normal(shape) * 0.5
        value = np.exp(value) if positive else value
        name = self.fresh("w")
        self.initializers.append(numpy_helper.from_array(value.astype(helper.tensor_dtype_to_np_dtype(self.dtype)),
                                                         name))
        return name

    def constant(self, values, name: str) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(values, np.int64), self.fresh(name)))
        return self.initializers[-1].name

    def add(self, op: str, inputs: list[str], shape: list[int], **attrs) -> None:
        out = self.fresh("v")
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"{op}_{len(self.nodes)}", **attrs))
        self.current, self.shape = out, shape

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "fuzz", [helper.make_tensor_value_info("x", self.dtype, self.start)],
                                  [helper.make_tensor_value_info(self.current, self.dtype, self.shape)],
                                  self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@st.composite
def graphs(draw) -> onnx.ModelProto:
    """A random chain of 1-4 ops after a first weight op (MatMul or a broadcasting binary op)."""
    dtype = draw(st.sampled_from([TensorProto.FLOAT, TensorProto.DOUBLE]))
    start = [draw(st.integers(2, 3))] + draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    g = Graph(dtype, start, list(start), rng=np.random.default_rng(draw(st.integers(0, 2**16))))
    _weight_op(draw, g, draw(st.sampled_from(["MatMul", *BINARY])))
    for _ in range(draw(st.integers(0, 4))):
        _random_op(draw, g)
    return g.model()


def _weight_op(draw, g: Graph, op: str) -> None:
    if op == "MatMul":
        columns = draw(st.integers(1, 4))
        g.add("MatMul", [g.current, g.weight([g.shape[-1], columns])], g.shape[:-1] + [columns])
        return
    dims = [d if draw(st.booleans()) else 1 for d in g.shape]  # broadcasting: some dims 1
    dims = dims[draw(st.integers(0, len(dims) - 1)):]  # and some leading dims dropped
    weight = g.weight(dims, positive=op == "Div")
    inputs = [g.current, weight] if op == "Div" or draw(st.booleans()) else [weight, g.current]
    if op == "Div" and inputs[0] == weight:
        inputs.reverse()
    g.add(op, inputs, list(g.shape))


def _random_op(draw, g: Graph) -> None:
    kind = draw(st.sampled_from(["unary", "weight", "gemm", "softmax", "reduce", "transpose"]))
    rank = len(g.shape)
    if kind == "unary":
        g.add(draw(st.sampled_from(UNARY)), [g.current], list(g.shape))
    elif kind == "weight":
        _weight_op(draw, g, draw(st.sampled_from(["MatMul", *BINARY])))
    elif kind == "gemm" and rank == 2:
        columns, trans_b = draw(st.integers(1, 4)), draw(st.integers(0, 1))
        shape_b = [columns, g.shape[1]] if trans_b else [g.shape[1], columns]
        bias = g.weight(draw(st.sampled_from([[columns], [1, columns], [g.shape[0], columns]])))
        g.add("Gemm", [g.current, g.weight(shape_b), bias], [g.shape[0], columns], transB=trans_b,
              alpha=draw(st.sampled_from([1.0, 0.5])), beta=draw(st.sampled_from([1.0, 2.0])))
    elif kind == "softmax":
        g.add("Softmax", [g.current], list(g.shape), axis=draw(st.integers(-rank, rank - 1)))
    elif kind == "reduce" and rank >= 2:
        axis = draw(st.integers(1, rank - 1))
        keep = 1 if rank == 2 else draw(st.integers(0, 1))
        shape = [1 if i == axis else d for i, d in enumerate(g.shape)] if keep else g.shape[:axis] + g.shape[axis + 1:]
        op = draw(st.sampled_from(["ReduceMean", "ReduceSum"]))
        g.add(op, [g.current, g.constant([axis], "axes")], shape, keepdims=keep)
    elif kind == "transpose" and rank >= 3:
        perm = [0] + draw(st.permutations(list(range(1, rank))))
        g.add("Transpose", [g.current], [g.shape[p] for p in perm], perm=perm)


@dataclass(frozen=True)
class Case:
    model: onnx.ModelProto
    loss: str
    optim: str
    optim_options: dict


@st.composite
def cases(draw) -> Case:
    model = draw(graphs())
    rank = len(model.graph.output[0].type.tensor_type.shape.dim)
    loss = draw(st.sampled_from([name for name in LOSSES if name != "ce" or rank == 2]))
    optim = draw(st.sampled_from(sorted(OPTIMIZERS)))
    return Case(model, loss, optim, draw(OPTIMIZERS[optim]))


def _target(loss: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if loss == "ce":
        return rng.integers(0, shape[1], shape[0])
    if loss == "bce_with_logits":
        return rng.random(shape)
    return rng.standard_normal(shape)


def _torch_loss(loss: str, output: np.ndarray | torch.Tensor, target: np.ndarray) -> torch.Tensor:
    """The loss by torch.nn.functional (in the output's dtype; a numpy output as float64)."""
    out = output if isinstance(output, torch.Tensor) else torch.from_numpy(np.asarray(output, np.float64))
    tgt = torch.from_numpy(target)
    functions = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss, "huber": F.huber_loss,
                 "ce": F.cross_entropy, "bce_with_logits": F.binary_cross_entropy_with_logits}
    return functions[loss](out, tgt if loss == "ce" else tgt.to(out.dtype))


def _torch_float32_noise(model: onnx.ModelProto, x64: np.ndarray, weights: list[str], loss: str,
                         target: np.ndarray) -> dict[str, float]:
    """Per weight, ``max |g32 - g64|`` of torch autograd on the imported program: the float32 noise of
    the computation itself (a gradient that is 0 in exact arithmetic is ~1e-8 in float32)."""
    from bridge.pipeline.importer.program import OnnxProgram

    grads = []
    for source, dtype in ((model, torch.float32), (as_float64(model), torch.float64)):
        program = OnnxProgram(load_model(source))
        params = {w: program.initializer_tensor(w).to(dtype).requires_grad_() for w in weights}
        output = program.run({"x": torch.from_numpy(x64).to(dtype)}, params, training=True)[0][0]
        grads.append(torch.autograd.grad(_torch_loss(loss, output, target), list(params.values()),
                                         allow_unused=True))
    return {w: 0.0 if g32 is None else float(torch.max(torch.abs(g32.double() - g64)))
            for w, g32, g64 in zip(weights, *grads, strict=True)}


def _fd_gradients(model64: onnx.ModelProto, x: np.ndarray, weights: dict, loss: str, target: np.ndarray,
                  h: float = 1e-6) -> dict[str, tuple[np.ndarray, float]]:
    """Per weight: the float64 central-difference gradient (all elements) and its measured noise."""
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(weights_as_inputs(model64, list(weights)), new_ops=REFERENCE_OPS)
    base = {"x": x, **{k: np.array(v, np.float64) for k, v in weights.items()}}

    def value(feed) -> float:
        return float(_torch_loss(loss, evaluator.run(None, feed)[0], target))

    result = {}
    for name, weight in weights.items():
        grad, noise = np.zeros(weight.size), 0.0
        for flat in range(weight.size):
            quotients = []
            for step in (h, 2 * h):
                scaled = step * max(1.0, abs(float(weight.reshape(-1)[flat])))
                plus, minus = dict(base), dict(base)
                plus[name], minus[name] = base[name].copy(), base[name].copy()
                plus[name].reshape(-1)[flat] += scaled
                minus[name].reshape(-1)[flat] -= scaled
                quotients.append((value(plus) - value(minus)) / (2 * scaled))
            grad[flat], noise = quotients[0], max(noise, abs(quotients[0] - quotients[1]))
        result[name] = (grad.reshape(weight.shape), noise)
    return result


def _torch_update(optim: str, options: dict, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """torch.optim's first step on ``weight`` with gradient ``grad``."""
    param = torch.nn.Parameter(torch.from_numpy(weight.copy()))
    optimizer = bridge.pipeline.optimizers.RULES[optim].torch_class([param], **options)
    param.grad = torch.from_numpy(np.array(grad))
    optimizer.step()
    return param.detach().numpy()


def check_case(case: Case) -> str:
    """Convert and run one step; returns "ok" or "refused" (a BridgeError); an assertion on a mismatch."""
    model = case.model
    try:
        tm = bridge.to_training_onnx(model, case.loss, case.optim, optim_options=case.optim_options)
    except bridge.BridgeError:
        return "refused"
    rng = np.random.default_rng(0)
    in_shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    numpy_dtype = helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type)
    x64 = rng.standard_normal(in_shape)
    model64 = as_float64(model)
    output = run_reference(model64, {"x": x64})[0]
    target = _target(case.loss, output.shape, rng)
    state = tm.initial_state()
    got = tm.session().step({"x": x64.astype(numpy_dtype)}, target.astype(tm.target_dtype))
    want_loss = float(_torch_loss(case.loss, output, target))
    weights = {w: state[w] for w in tm.weights}
    fd = _fd_gradients(model64, x64, weights, case.loss, target)
    float32 = numpy_dtype == np.float32
    loss_bound = (FLOAT32_ULPS * FLOAT32_EPS if float32 else 1e-12) * max(1.0, abs(want_loss))
    assert abs(float(got["loss"]) - want_loss) <= loss_bound, (got["loss"], want_loss)
    torch_noise = _torch_float32_noise(model, x64, tm.weights, case.loss, target) if float32 else {}
    for name, (want, noise) in fd.items():
        grad = np.asarray(got[f"grad_{name}"], np.float64)
        scale = max(scale_of(want), scale_of(grad), 1e-30)
        # as tests/helpers/oracle.py: a float64 floor relative to max(scale, 1) (an exact 0 is ~1e-17)
        floor = FLOAT32_ULPS * FLOAT32_EPS * scale if float32 else FLOAT64_FLOOR * max(scale, 1.0)
        bound = FD_NOISE_FACTOR * noise + floor
        bound = max(bound, TORCH_NOISE_FACTOR * torch_noise.get(name, 0.0))
        assert np.max(np.abs(grad - want)) <= bound, f"grad_{name}: {grad} vs finite differences {want}"
        if not float32:
            update = _torch_update(case.optim, case.optim_options, weights[name], got[f"grad_{name}"])
            error = np.max(np.abs(got[f"updated_{name}"] - update))
            assert error <= UPDATE_ULPS * np.finfo(np.float64).eps * max(scale_of(update), 1.0), name
    return "ok"


def _run_graph_fuzz(examples: int, record_property) -> None:
    outcomes: list[str] = []

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(cases())
    def run(case: Case) -> None:
        outcomes.append(check_case(case))

    run()
    record_property("summary", f"graph fuzz: {len(outcomes)} examples, {outcomes.count('ok')} matched the oracles, "
                               f"{outcomes.count('refused')} refused with a BridgeError")
    assert len(outcomes) >= examples // 2 and outcomes.count("ok") >= len(outcomes) // 2


def test_graph_fuzz(record_property):
    _run_graph_fuzz(CI_EXAMPLES, record_property)


@pytest.mark.exhaustive
def test_graph_fuzz_long(record_property):
    _run_graph_fuzz(LONG_EXAMPLES, record_property)


@st.composite
def mutations(draw) -> bytes:
    """The bytes of a valid model with 1-8 bytes overwritten, a slice deleted or the file truncated."""
    data = bytearray(MLP.read_bytes())
    kind = draw(st.sampled_from(["overwrite", "delete", "truncate"]))
    if kind == "truncate":
        return bytes(data[:draw(st.integers(0, len(data) - 1))])
    start = draw(st.integers(0, len(data) - 1))
    if kind == "delete":
        return bytes(data[:start] + data[start + draw(st.integers(1, 64)):])
    for offset, byte in enumerate(draw(st.binary(min_size=1, max_size=8))):
        data[(start + offset) % len(data)] = byte
    return bytes(data)


def _run_loader_fuzz(examples: int, tmp_path: Path, record_property) -> None:
    outcomes: list[str] = []
    path = tmp_path / "mutated.onnx"

    @seed(SEED)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(mutations())
    def run(data: bytes) -> None:
        path.write_bytes(data)
        try:
            load_model(path)
            outcomes.append("loaded")
        except bridge.ModelLoadError as exc:
            assert "mutated.onnx" in str(exc)
            outcomes.append("refused")

    run()
    record_property("summary", f"loader fuzz: {len(outcomes)} mutated models, {outcomes.count('refused')} refused "
                               f"with ModelLoadError, {outcomes.count('loaded')} still valid")
    assert len(outcomes) == examples and outcomes.count("refused") > 0


def test_loader_fuzz(tmp_path, record_property):
    _run_loader_fuzz(CI_LOADER_EXAMPLES, tmp_path, record_property)


@pytest.mark.exhaustive
def test_loader_fuzz_long(tmp_path, record_property):
    _run_loader_fuzz(LONG_EXAMPLES * 10, tmp_path, record_property)
