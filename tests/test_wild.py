"""The wild tier: real ONNX files from other exporters and from published wheels
(tests/wild/manifest.json, built by tests/wild/build.py) train correctly or are refused as the
manifest expects. Correct means: bridge's float64 step has the loss and gradients of an oracle
that shares no code with bridge (float64 finite differences of the original file,
tests/wild/oracle.py), an oracle shown to reject a gradient off by 1% or of the wrong sign; its
float32 step agrees with the float64 one within the file's own float32 noise (the larger of a
multiple of the output's float32 error times the largest gradient, and a multiple of how far
float32 rounding of the weights and inputs alone moves the float64 gradient) and updates each
weight by ``-lr * grad``. The committed small files run in the default tier, the cached ones
(``python tests/wild/build.py``) in the exhaustive tier."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from generated_docs import assert_generated_block_current
from helpers.oracle import step_outputs
from wild.oracle import (
    STEPS,
    Check,
    Oracle,
    as_array,
    check_gradients,
    oracle,
    reference_run,
    rejects_wrong_gradients,
    to_double,
    train_mode,
)
from wild.weights import reinitialized

import bridge
from bridge import errors

HERE = Path(__file__).parent / "wild"
MANIFEST = json.loads((HERE / "manifest.json").read_text())
CACHE = Path(os.environ.get("BRIDGE_WILD_CACHE", Path.home() / ".cache" / "bridge-wild"))
LR = 0.01
LOSS_RTOL = 1e-9  # two float64 evaluations of the same loss (summation order only)
# float32 gradient error allowed, in units of the file's float32 forward noise times the largest gradient
FLOAT32_NOISE_MULTIPLE = 100.0
# float32 gradient error allowed, in units of how far one float32 rounding of every weight and input moves the
# float64 gradient: the float32 step rounds every value it computes as well, not only those it is fed
FLOAT32_ROUNDING_MULTIPLE = 4.0
FLOAT32_ROUNDING_DRAWS = 3
MAX_TENSORS_CHECKED_ALONE = 8  # big models: this many tensors get their own directions; all get joint ones


def _path(name: str, entry: dict) -> Path:
    path = (HERE / "files" if entry["location"] == "files" else CACHE) / entry["file"]
    if not path.exists():
        pytest.skip(f"{path} missing: run `python tests/wild/build.py` to fetch the wild tier")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], f"{path} differs from the manifest: rebuild"
    return path


def _load(name: str, entry: dict) -> onnx.ModelProto:
    """The file, with its weights drawn anew where the manifest's ``weights`` option says so
    (the same model then goes to bridge and to the oracle)."""
    model = onnx.load(_path(name, entry))
    return reinitialized(model, entry["weights"]) if "weights" in entry else model


def _numpy_dtype(model: onnx.ModelProto, name: str) -> np.dtype:
    elem = next(i for i in model.graph.input if i.name == name).type.tensor_type.elem_type
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))


def feeds_for(name: str, entry: dict, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Seeded inputs as the manifest describes them (normal, uniform in [0, 1), int:low:high), and
    the pinned inputs at their values."""
    rng = np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
    feeds = {}
    for input_name, (shape, kind) in entry["inputs"].items():
        dtype = _numpy_dtype(model, input_name)
        if kind.startswith("int:"):
            low, high = map(int, kind.split(":")[1:])
            feeds[input_name] = rng.integers(low, high, shape).astype(dtype)
        else:
            feeds[input_name] = (rng.standard_normal(shape) if kind == "normal" else rng.random(shape)).astype(dtype)
    for input_name, value in entry.get("constant_inputs", {}).items():
        feeds[input_name] = np.array(value, _numpy_dtype(model, input_name))
    return feeds


@dataclass
class WildResult:
    """What one file's check measured."""

    engine: str
    checks: list[Check]
    power: dict[str, bool]
    failures: list[str] = field(default_factory=list)
    float32: dict[str, Float32Check] = field(default_factory=dict)


@dataclass
class Float32Check:
    """One tensor's float32 gradient against the float64 one: the error, the forward-noise bound and
    the measured rounding noise (None where the forward-noise bound alone passed it)."""

    error: float
    forward_bound: float
    rounding_noise: float | None = None

    @property
    def bound(self) -> float:
        return max(self.forward_bound, FLOAT32_ROUNDING_MULTIPLE * (self.rounding_noise or 0.0))


def _noise_inputs(tm: bridge.TrainingModel) -> dict[str, np.ndarray]:
    """Dropout noise that keeps every unit (the oracle's Dropout is ``x / (1 - ratio)``)."""
    by_name = {i.name: i for i in tm.model.graph.input}
    return {name: np.ones([d.dim_value for d in by_name[name].type.tensor_type.shape.dim],
                          onnx.helper.tensor_dtype_to_np_dtype(by_name[name].type.tensor_type.elem_type))
            for name in tm.signature.random}


def _float32_forward_noise(model: onnx.ModelProto, output: str, feeds: dict, reference: np.ndarray) -> float:
    """How far onnxruntime's float32 run of the file (in train mode) is from the float64 oracle,
    relative to the output's scale: the file's own float32 noise."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(train_mode(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    got = as_array(session.run([output], {k: v for k, v in feeds.items() if k in inputs})[0])
    scale = float(np.max(np.abs(reference))) or 1.0
    return float(np.max(np.abs(got - reference))) / scale


def _float32_rounded(values: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Each float value times ``1 + u * 2^-24``, ``u`` a random sign: a float32 rounding of it."""
    return {k: v * (1 + rng.choice([-1.0, 1.0], v.shape) * 2.0**-24) if v.dtype.kind == "f" else v
            for k, v in values.items()}


def _float32_rounding_noise(tm64: bridge.TrainingModel, feeds64: dict[str, np.ndarray], target: np.ndarray,
                            grads64: dict[str, np.ndarray]) -> dict[str, float]:
    """Per weight, the largest change of bridge's float64 gradient (checked against the oracle) over
    seeded draws that round every weight, input and float target as float32 would: the gradient's
    float32 noise measured without bridge's float32 arithmetic."""
    rng = np.random.default_rng(0)
    state = {w: v for w, v in tm64.initial_state().items() if w in grads64}
    noise = dict.fromkeys(grads64, 0.0)
    for _ in range(FLOAT32_ROUNDING_DRAWS):
        rounded = _float32_rounded({**state, **feeds64, "target": np.asarray(target)}, rng)
        target_drawn = rounded.pop("target")
        got = step_outputs(tm64, rounded, target_drawn, _noise_inputs(tm64))
        for w, g in grads64.items():
            change = np.max(np.abs(np.asarray(got[f"grad_{w}"], np.float64) - g), initial=0.0)
            noise[w] = max(noise[w], float(change))
    return noise


def _sampled(weights: list[str], state: dict[str, np.ndarray], seed: int) -> list[str]:
    """Every weight, or for big models the largest, the smallest, the first, the last and random others."""
    if len(weights) <= MAX_TENSORS_CHECKED_ALONE:
        return weights
    by_size = sorted(weights, key=lambda w: state[w].size)
    chosen = dict.fromkeys([by_size[-1], by_size[0], weights[0], weights[-1]])
    rest = [w for w in weights if w not in chosen]
    picks = np.random.default_rng(seed).choice(len(rest), MAX_TENSORS_CHECKED_ALONE - len(chosen), replace=False)
    return list(chosen) + [rest[i] for i in sorted(picks)]


def check_wild_file(name: str, entry: dict) -> WildResult:
    """Convert one manifest file (mse or ce, SGD) in float32 and float64, step once, compare with the oracle."""
    model = _load(name, entry)
    output = entry.get("output") or model.graph.output[0].name
    options = {"loss": entry["loss"], "optim": "sgd", "optim_options": {"lr": LR}, "output": output,
               "input_shapes": {k: shape for k, (shape, _) in entry["inputs"].items()},
               "constant_inputs": entry.get("constant_inputs"), **entry.get("options", {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm32 = bridge.to_training_onnx(model, **options)
        tm64 = bridge.to_training_onnx(to_double(model), **options)
    feeds = feeds_for(name, entry, model)
    step_feeds = {k: v for k, v in feeds.items() if k not in entry.get("constant_inputs", {})}
    truth = oracle(model, output, tm64.weights, feeds)
    reference = truth.output({})
    rng = np.random.default_rng(0)
    if entry["loss"] == "ce":
        target = rng.integers(0, reference.shape[1], (reference.shape[0], *reference.shape[2:]))
    else:
        target = rng.standard_normal(reference.shape)
    truth.loss, truth.target = entry["loss"], target
    feeds64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in step_feeds.items()}
    got64 = step_outputs(tm64, feeds64, target, _noise_inputs(tm64))
    target32 = target.astype(np.float32) if entry["loss"] == "mse" else target
    got32 = step_outputs(tm32, step_feeds, target32, _noise_inputs(tm32))

    failures = []
    state64, state32 = tm64.initial_state(), tm32.initial_state()
    for w in tm64.weights:
        if not np.array_equal(state64[w], truth.base[w]):
            failures.append(f"{w}: bridge's initial value is not the file's")
    loss = truth.loss_of({})
    if abs(float(got64["loss"]) - loss) > LOSS_RTOL * max(1.0, abs(loss)):
        failures.append(f"loss {float(got64['loss'])!r} != oracle {loss!r}")
    grads64 = {w: got64[f"grad_{w}"] for w in tm64.weights}
    checks = check_gradients(truth, grads64, per_tensor=_sampled(tm64.weights, state64, 0))
    failures += [f"d/d{'+'.join(c.weights) if len(c.weights) < 3 else 'all'}: bridge {c.analytic:.9g}, "
                 f"oracle {c.fd:.9g} (tolerance {c.tolerance:.3g})" for c in checks if not c.ok]
    power = rejects_wrong_gradients(checks)
    failures += [f"the oracle does not reject a gradient {how}" for how, ok in power.items() if not ok]

    noise = max(_float32_forward_noise(model, output, feeds, reference), float(np.finfo(np.float32).eps))
    scale = max(float(np.max(np.abs(g), initial=0.0)) for g in grads64.values()) or 1e-30
    grads32 = {w: np.asarray(got32[f"grad_{w}"], np.float64) for w in tm32.weights}
    float32 = {w: Float32Check(float(np.max(np.abs(grads32[w] - grads64[w]), initial=0.0)),
                               FLOAT32_NOISE_MULTIPLE * noise * scale) for w in tm32.weights}
    if any(c.error > c.bound for c in float32.values()):  # measured only where the forward-noise bound is short
        for w, rounding in _float32_rounding_noise(tm64, feeds64, target, grads64).items():
            float32[w].rounding_noise = rounding
    failures += [f"grad_{w} float32 off by {c.error:.3g} > {c.bound:.3g}" for w, c in float32.items()
                 if c.error > c.bound]
    # a widened bound must still reject a float32 gradient of the wrong sign; a 1% error is the float64
    # check's to catch (its oracle rejects one), since deep nets' float32 gradient noise can exceed 1%
    widened = any(c.rounding_noise is not None for c in float32.values())
    if widened and not any(np.max(np.abs(grads32[w] + grads64[w]), initial=0.0) > float32[w].bound for w in float32):
        failures.append("the float32 bound does not reject a float32 gradient of the wrong sign")
    for w in tm32.weights:
        want = state32[w].astype(np.float64) - LR * np.asarray(got32[f"grad_{w}"], np.float32).astype(np.float64)
        if np.max(np.abs(got32[f"updated_{w}"] - want), initial=0.0) > np.finfo(np.float32).eps * max(np.max(np.abs(want), initial=0.0), 1e-30):
            failures.append(f"updated_{w} is not {w} - lr * grad_{w}")
    return WildResult(truth.engine, checks, power, failures, float32)


def _cases(location: str) -> list:
    marks = [] if location == "files" else [pytest.mark.exhaustive]
    cases = []
    for name, entry in MANIFEST.items():
        if entry["location"] != location:
            continue
        expected = entry["expected"]
        case_marks = list(marks)
        if expected["result"] in ("gap", "needs output pruning"):
            case_marks.append(pytest.mark.xfail(strict=True, raises=errors.BridgeError, reason=expected["why"]))
        if expected["result"] == "open":
            case_marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=expected["why"]))
        cases.append(pytest.param(name, entry, marks=case_marks, id=name))
    return cases


def _run_case(name: str, entry: dict) -> None:
    expected = entry["expected"]
    if expected["result"] == "refused":
        with pytest.raises(getattr(errors, expected["error"]), match=expected["match"]):
            check_wild_file(name, entry)
        return
    result = check_wild_file(name, entry)
    assert result.failures == [], f"{name} ({result.engine}): " + "; ".join(result.failures)


@pytest.mark.parametrize(("name", "entry"), _cases("files"))
def test_committed_wild_file(name, entry):
    _run_case(name, entry)


@pytest.mark.parametrize(("name", "entry"), _cases("cache"))
def test_cached_wild_file(name, entry):
    _run_case(name, entry)


def test_the_tier_holds_20_files_from_6_exporters():
    """Issue 33's floor for the tier: at least 20 files from at least 6 exporters (an exporter is
    the first word of the manifest's name for it: torch 2.3 and torch 2.11 are one)."""
    exporters = {entry["exporter"].split()[0] for entry in MANIFEST.values()}
    assert len(MANIFEST) >= 20 and len(exporters) >= 6, (len(MANIFEST), sorted(exporters))


def test_docs_list_the_wild_tier():
    assert_generated_block_current("wild_tier.py", "models.md", "table")


def test_the_oracle_passes_a_true_gradient_and_rejects_wrong_ones():
    """y = tanh(x @ w) with its gradient written out in numpy: the oracle passes it and rejects
    it scaled by 1.01 or sign-flipped."""
    rng = np.random.default_rng(0)
    x, w, target = rng.standard_normal((4, 3)), rng.standard_normal((3, 2)), rng.standard_normal((4, 2))
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["m"]), onnx.helper.make_node("Tanh", ["m"], ["y"])], "tanh",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 2])],
        [onnx.numpy_helper.from_array(w.astype(np.float32), "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    truth = oracle(model, "y", ["w"], {"x": x})
    truth.target = target
    y = np.tanh(x @ truth.base["w"])
    grad = x.T @ (2 * (y - target) / y.size * (1 - y**2))
    checks = check_gradients(truth, {"w": grad})
    assert all(c.ok for c in checks)
    assert all(rejects_wrong_gradients(checks).values())
    for wrong in (1.01 * grad, -grad):
        assert not all(c.ok for c in check_gradients(truth, {"w": wrong}))


@pytest.mark.parametrize("op_type", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("axis", [None, 2, -3])
def test_the_oracles_reference_engine_runs_softmax_as_its_opset_defines(op_type, axis):
    """Before opset 13 Softmax, LogSoftmax and Hardmax normalize over every axis from ``axis`` on
    (default 1): the oracle's onnx.reference engine agrees with onnxruntime on an opset-11 model."""
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    attrs = {} if axis is None else {"axis": axis}
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(op_type, ["x"], ["y"], **attrs)], op_type,
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x.shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(x.shape))])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 11)])
    got = reference_run(to_double(model), ["y"])({"x": x})[0]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(["y"], {"x": x.astype(np.float32)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32 rounding of onnxruntime's run


POOLS = [("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1]}),
         ("MaxPool", {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
         ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
         ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
         ("AveragePool", {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "count_include_pad": 1}),
         ("AveragePool", {"kernel_shape": [3, 3], "auto_pad": "VALID"}),
         ("AveragePool", {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}),
         ("LRN", {"size": 5, "alpha": 0.5, "beta": 0.75, "bias": 1.5}), ("LRN", {"size": 3})]


@pytest.mark.parametrize(("op_type", "attrs"), POOLS, ids=[f"{op}-{i}" for i, (op, _) in enumerate(POOLS)])
def test_the_oracles_reference_engine_pools_and_normalizes_as_onnxruntime(op_type, attrs):
    """The oracle's own MaxPool, AveragePool (window reductions, the reference's loops where they do
    not apply) and LRN (onnx.reference's normalizes only the first batch-size channels) agree with
    onnxruntime at batch 2 over 6 channels."""
    shape = (2, 6, 9) if len(attrs.get("kernel_shape", [0, 0])) == 1 else (2, 6, 9, 8)
    x = np.random.default_rng(0).standard_normal(shape)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node(op_type, ["x"], ["y"], **attrs)], op_type,
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(shape))],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    got = reference_run(to_double(model), ["y"])({"x": x})[0]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(["y"], {"x": x.astype(np.float32)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # float32 rounding of onnxruntime's run


def test_the_oracle_measures_again_where_both_steps_cross_a_kink():
    """An output that bends by 1% beyond 2e-5 of the base point (a kink both default steps cross):
    their estimates agree with each other but not with the derivative at the base; the smaller
    steps pass the true gradient and still reject wrong ones."""
    base = np.array([0.5])

    def output(values):
        offset = values.get("w", base) - base
        return base + offset * np.where(np.abs(offset) >= 2e-5, 1.01, 1.0)

    truth = Oracle("numpy", {"w": base}, output, target=np.array([2.0]))
    grad = 2 * (base - truth.target)
    step = STEPS[1]
    crossing = (truth.loss_of({"w": base + step}) - truth.loss_of({"w": base - step})) / (2 * step)
    assert abs(crossing - grad[0]) > 0.005 * abs(grad[0])  # the default steps alone reject the true gradient
    checks = check_gradients(truth, {"w": grad})
    assert all(c.ok for c in checks)
    assert all(rejects_wrong_gradients(checks).values())


def _caffe2_like() -> onnx.ModelProto:
    """An IR-3 model as onnx's light files store weights: Conv and Gemm weights as ConstantOfShape
    fills of int64 shape initializers, biases and BatchNormalization parameters as float
    initializers, every initializer also a graph input."""
    h, nh, T = onnx.helper, onnx.numpy_helper, onnx.TensorProto
    rng = np.random.default_rng(0)
    floats = {"conv_b": rng.standard_normal(4), "bn_scale": rng.random(4) + 0.5, "bn_bias": rng.standard_normal(4),
              "bn_mean": rng.standard_normal(4), "bn_var": rng.random(4) + 0.5, "fc_b": rng.standard_normal(3)}
    fills = {"conv_w": [4, 2, 3, 3], "fc_w": [3, 36]}
    initializers = [nh.from_array(v.astype(np.float32), k) for k, v in floats.items()]
    initializers += [nh.from_array(np.array(dims, np.int64), f"{k}__SHAPE") for k, dims in fills.items()]
    nodes = [h.make_node("ConstantOfShape", [f"{k}__SHAPE"], [k], value=nh.from_array(np.array([0.02], np.float32)))
             for k in fills]
    nodes += [h.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"]),
              h.make_node("BatchNormalization", ["c", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n"]),
              h.make_node("Relu", ["n"], ["r"]), h.make_node("Flatten", ["r"], ["f"]),
              h.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], transB=1), h.make_node("Softmax", ["logits"], ["y"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [2, 2, 5, 5])]
    inputs += [h.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers]
    graph = h.make_graph(nodes, "caffe2_like", inputs, [h.make_tensor_value_info("y", T.FLOAT, [2, 3])], initializers)
    return h.make_model(graph, ir_version=3, opset_imports=[h.make_opsetid("", 9)])


def _reinit_models() -> list:
    cases = [pytest.param(_caffe2_like, id="caffe2_like")]
    cases += [pytest.param(lambda name=name, entry=entry: onnx.load(_path(name, entry)), id=name)
              for name, entry in MANIFEST.items() if "weights" in entry]
    return cases


def _shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    return {v.name: (v.type.tensor_type.elem_type, tuple(d.dim_value for d in v.type.tensor_type.shape.dim))
            for v in [*inferred.value_info, *inferred.output]}


@pytest.mark.parametrize("load", _reinit_models())
def test_reinitialized_weights_keep_every_node_input_and_shape(load):
    """The ``weights`` option's rewrite: fills become initializers of the same name, shape and type;
    every other node, the data inputs, the outputs and every value's shape are kept; no weight is
    left constant; the same seed draws the same file, another seed another."""
    model = load()
    options = {"reinit": "fan_in_normal", "seed": 0}
    rewritten = reinitialized(model, options)
    onnx.checker.check_model(rewritten, full_check=True)
    shapes = {t.name: tuple(onnx.numpy_helper.to_array(t).tolist()) for t in model.graph.initializer
              if t.data_type == onnx.TensorProto.INT64}
    fills = {n.output[0]: shapes[n.input[0]] for n in model.graph.node if n.op_type == "ConstantOfShape" and n.input[0] in shapes}
    assert list(rewritten.graph.node) == [n for n in model.graph.node if n.output[0] not in fills]
    initializers = {t.name for t in model.graph.initializer}
    assert [i for i in rewritten.graph.input if i.name not in initializers | set(fills)] == \
        [i for i in model.graph.input if i.name not in initializers]
    assert list(rewritten.graph.output) == list(model.graph.output)
    before, after = _shapes(model), _shapes(rewritten)
    assert {k: v for k, v in before.items() if k not in fills} == {k: v for k, v in after.items() if k not in fills}
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in rewritten.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert {name: weights[name].shape for name in fills} == fills
    assert all(np.all(np.isfinite(w)) and (w.size == 1 or np.ptp(w) > 0) for w in weights.values())
    assert rewritten.SerializeToString() == reinitialized(model, options).SerializeToString()
    assert rewritten.SerializeToString() != reinitialized(model, {**options, "seed": 1}).SerializeToString()
