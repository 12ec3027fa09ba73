"""The ONNX backend node test suite as bridge's conformance suite.

The subset: node tests of ``onnx.backend.test.loader.load_model_tests(kind="node")`` whose model
imports only the default domain at opset <= ``KNOWN_OPSET`` and whose every node (subgraphs
included) is an op of onnx-mlir's CPU table (``bridge/data/onnx_mlir_cpu_ops.json``).

Each test gets four verdicts (strings, recorded in ``tests/onnx_node_expectations.json``):

- ``forward``: ``"unsupported"`` (bridge's importer has no converter for one of the model's ops:
  ``UnsupportedOpError`` when ``OnnxProgram`` is built), ``"pass"`` (the importer's outputs equal
  the test's expected outputs within the test's rtol/atol, as ONNX's own backend runner
  compares them), or ``"fail: <cause>"``;
- ``onnxruntime``: the same comparison for onnxruntime on the same model;
- ``grad``: ``"n/a: <why>"`` for tests that are no gradient case (see ``gradient_case``), else
  every floating-point input becomes a trainable initializer (its value from the data set) and
  ``helpers.oracle.check_training_step`` runs one mse + SGD step: ``"pass"`` or
  ``"fail: <failed checks>"``. The oracle is float64 finite differences, except for tests whose
  data sit at a kink (``AT_KINKS``): there torch's convention is the truth (a torch twin);
- ``onnx_mlir``: the same float32 training graph compiled by onnx-mlir and stepped against
  onnxruntime (``onnx_mlir_verdict``); each failure's cause is in ``repros.onnx_mlir_defects.NODE_DEFECTS``.

Run ``python tests/onnx_node_suite.py`` to rewrite the expectations file from a full run
(``--onnx-mlir``: the onnx-mlir verdicts), or set ``BRIDGE_UPDATE_EXPECTATIONS=1`` for a pytest run
(tests/test_onnx_node_suite.py).
"""
from __future__ import annotations

import functools
import json
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F  # noqa: N812
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner, _normalize_tensor

sys.path.insert(0, str(Path(__file__).parent))

from helpers.compiled import step_mismatches  # noqa: E402
from helpers.importer import run_onnxruntime  # noqa: E402
from helpers.oracle import OPTIONS, _random_noise, check_training_step  # noqa: E402

import bridge  # noqa: E402
from bridge.errors import UnsupportedOpError  # noqa: E402
from bridge.onnx_file import all_nodes as _all_nodes  # noqa: E402
from bridge.onnx_file import subgraphs
from bridge.pipeline.importer.program import OnnxProgram  # noqa: E402
from bridge.pipeline.importer.registry import CONVERTERS, import_all_converters  # noqa: E402
from bridge.pipeline.importer.weights import differentiable_initializers  # noqa: E402
from bridge.pipeline.load import KNOWN_OPSET, load_model  # noqa: E402
from bridge.tools.compile import CompileError  # noqa: E402

ROOT = Path(__file__).parent.parent
EXPECTATIONS = Path(__file__).parent / "onnx_node_expectations.json"
MLIR_OPS = json.loads((ROOT / "bridge" / "data" / "onnx_mlir_cpu_ops.json").read_text())["ops"]
FLOAT_TYPES = (np.float32, np.float64)
FD_BUDGET_S = 10.0  # finite differences of the 3-D pooling tests sample fewer elements
LOSS_RTOL = 2.0**-24  # float32 attributes (HardSigmoid's alpha) widened differently: ~1e-9

# Ops whose output is piecewise constant in, or independent of, the values of its float inputs,
# or random: their gradient is zero (or undefined at the test's points, e.g. Round at 0.5),
# so a finite-difference check means nothing. BatchNormalization trains with batch statistics
# (torch's train mode), not the inference graph's running ones that the oracle differentiates.
NOT_DIFFERENTIABLE = {
    "BatchNormalization": "trains with batch statistics, not the graph's inference semantics",
    "Floor": "piecewise constant", "Ceil": "piecewise constant", "Round": "piecewise constant",
    "Sign": "piecewise constant", "Hardmax": "piecewise constant",
    "EyeLike": "output independent of input values", "Shape": "output independent of input values",
    "Size": "output independent of input values", "ConstantOfShape": "output independent of input values",
    "RandomNormal": "random", "RandomNormalLike": "random", "RandomUniform": "random",
    "RandomUniformLike": "random", "Bernoulli": "random", "Multinomial": "random",
    "Dropout": "random", "Range": "output shape depends on input values",
}

# Tests whose data sit where the function has no derivative: finite differences there mean nothing.
NON_DIFFERENTIABLE_POINTS = {
    "test_acosh_example": "x=1, where acosh's derivative is infinite",
    "test_pow": "x=0 with non-integer exponents, the edge of Pow's domain",
    "test_gridsample_aligncorners_true": "grid points at integer pixel coordinates: linear interpolation's kink",
    "test_gridsample_bilinear": "grid points at integer pixel coordinates: linear interpolation's kink",
    "test_gridsample_bilinear_align_corners_1_additional_1": "grid points at integer pixel coordinates: linear interpolation's kink",
    "test_gridsample_volumetric_bilinear_align_corners_0": "grid points at integer pixel coordinates: linear interpolation's kink",
    "test_gridsample_volumetric_bilinear_align_corners_1": "grid points at integer pixel coordinates: linear interpolation's kink",
}


def _below_zero(negative, positive):
    """An expanded function body's ``Where(Less(x, 0), negative(x), positive(x))`` in torch."""
    return lambda x: torch.where(x < 0, negative(x), positive(x))


# Tests whose data sit at a kink (x = 0 of the ReLU family, zeros under a norm, ties of a min or a
# max pool): the gradient oracle is torch's convention there, the float64 autograd of a torch twin
# of the test's model (its inputs by name), not finite differences. An expanded test's twin is
# its function body written in torch (its own ``Where`` picks the side).
AT_KINKS = {
    "test_elu_example": lambda x: F.elu(x, 2.0),
    "test_elu_example_expanded_ver18": _below_zero(lambda x: 2.0 * (torch.exp(x) - 1), lambda x: x),
    "test_selu_example": lambda x: 3.0 * F.elu(x, 2.0),
    "test_selu_example_expanded_ver18": _below_zero(lambda x: 3.0 * (2.0 * torch.exp(x) - 2.0), lambda x: 3.0 * x),
    "test_leakyrelu_example": lambda x: F.leaky_relu(x, float(np.float32(0.1))),
    "test_leakyrelu_example_expanded": _below_zero(lambda x: float(np.float32(0.1)) * x, lambda x: x),
    "test_l1normalization_axis_last": lambda x: F.normalize(x, 1.0, -1),
    "test_l2normalization_axis_0": lambda x: F.normalize(x, 2.0, 0),
    "test_reduce_min_default_axes_keepdims_example": lambda data: torch.amin(data, dim=(0, 1, 2), keepdim=True),
    "test_maxpool_3d_dilations": lambda x: F.max_pool3d(x, 2, 1, dilation=2),
    "test_maxpool_3d_dilations_use_ref_impl": lambda x: F.max_pool3d(x, 2, 1, dilation=2),
}
# Gradient checks not run (their verdict is recorded as is): they would take the machine down.
NOT_RUN = {
    "test_maxpool_3d_dilations_use_ref_impl_large":
        "fail: not run: bridge's max_pool backward lowering allocates a 4 GB tensor (kernel 5x5x5, dilations 2)",
}


def op_types(model: onnx.ModelProto) -> list[str]:
    """The op types of a model's nodes, subgraphs included, sorted."""
    return sorted({node.op_type for node in _all_nodes(model.graph)})


def in_subset(model: onnx.ModelProto | None) -> bool:
    """Default domain only, opset <= KNOWN_OPSET, every node in onnx-mlir's CPU table."""
    if model is None:
        return False
    domains = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    if set(domains) != {"ai.onnx"} or domains["ai.onnx"] > KNOWN_OPSET:
        return False
    return all(node.domain in ("", "ai.onnx") and MLIR_OPS.get(node.op_type, {}).get("supported")
               for node in _all_nodes(model.graph))


@functools.cache
def cases() -> dict[str, Any]:
    """The subset's test cases by name (built once per process: ~10 s)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tests = load_model_tests(kind="node")
    return {t.name: t for t in sorted(tests, key=lambda t: t.name) if in_subset(t.model)}


def _value(item):
    """A data-set value as numpy (a 0-d array for a numpy scalar; a list for a sequence)."""
    value = _normalize_tensor(item)
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value if value is None or isinstance(value, np.ndarray) else np.asarray(value)


def data_sets(case) -> list[tuple[dict[str, Any], list[Any]]]:
    """(feeds by graph input name, expected outputs) of each data set."""
    names = [i.name for i in case.model.graph.input]
    return [(dict(zip(names, [_value(x) for x in inputs], strict=True)), [_value(y) for y in outputs])
            for inputs, outputs in case.data_sets]


def _to_torch(value):
    if isinstance(value, list):
        return [_to_torch(v) for v in value]
    return None if value is None else torch.from_numpy(np.array(value, copy=True))


def _to_numpy(value):
    if isinstance(value, list):
        return [_to_numpy(v) for v in value]
    return None if value is None else value.detach().numpy()


def static_inputs(model: onnx.ModelProto) -> set[str]:
    """Graph inputs whose values an input bridge needs before the model runs depends on
    (``static=`` of the node's converter: Slice starts, Resize scales, Reduce axes, ...), directly
    or through other nodes (an expanded function computing pads from its ``shape`` input);
    ``Shape``/``Size`` read only the shape of their input, not its values."""
    import_all_converters()
    names = {i.name for i in model.graph.input}
    nodes = list(_all_nodes(model.graph))  # a subgraph's node reads outer values by name
    producers = {out: node for node in nodes for out in node.output}
    pending = [node.input[index] for node in nodes if node.op_type in CONVERTERS
               for index in CONVERTERS[node.op_type].static if index < len(node.input) and node.input[index]]
    needed: set[str] = set()
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producers.get(name)
        if node is not None and node.op_type not in ("Shape", "Size"):
            pending.extend(i for sub in [node, *(n for sub in subgraphs(node) for n in _all_nodes(sub))] for i in sub.input if i)
    return needed & names


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the graph inputs ``values`` turned into initializers of these values (before IR
    version 4 an initializer must also be a graph input: those stay inputs, with a default value)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    kept = [i for i in result.graph.input if i.name not in values or result.ir_version < 4]
    del result.graph.input[:]
    result.graph.input.extend(kept)
    result.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in values.items())
    return result


def bridge_source(model: onnx.ModelProto, feeds: dict[str, Any]) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """What bridge is given: the inputs that must be constants (``static_inputs``) become
    initializers (a model exported for bridge has them as constants); the others stay inputs."""
    static = static_inputs(model)
    constants = {k: v for k, v in feeds.items() if k in static and isinstance(v, np.ndarray)}
    return with_initializers(model, constants), {k: v for k, v in feeds.items() if k not in constants}


def run_bridge(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """The model's outputs through bridge's importer (``bridge_source``: inputs fed, initializers
    kept)."""
    model, feeds = bridge_source(model, feeds)
    program = OnnxProgram(load_model(model))
    tensors = {n: program.initializer_tensor(n) for n in program.floating_initializers()}  # weights, as in a conversion
    with torch.no_grad():
        outputs, _ = program.run({k: _to_torch(v) for k, v in feeds.items()}, tensors, training=False)
    return [_to_numpy(o) for o in outputs]


def _short(exc: BaseException) -> str:
    """A one-line, run-independent description of an exception."""
    line = (str(exc).strip().splitlines() or [""])[0]
    line = re.sub(r"0x[0-9a-f]+", "0x..", line)
    return f"{type(exc).__name__}: {line[:110]}"


def _mismatch(exc: BaseException) -> str:
    """What ``Runner.assert_similar_outputs`` found different."""
    message = str(exc)
    if "Not equal to tolerance" in message:
        return "wrong result"
    if "incorrect shape" in message:
        return "wrong shape"
    if "dtype" in message:
        return "wrong dtype"
    return "wrong output type or count"


def _compare(case, run) -> str:
    """``"pass"`` or ``"fail: <cause>"`` for one runner over every data set of ``case``."""
    for feeds, expected in data_sets(case):
        try:
            got = run(case.model, feeds)
        except Exception as exc:  # noqa: BLE001 - every crash is a verdict
            return f"fail: crash: {_short(exc)}"
        try:
            Runner.assert_similar_outputs(expected, got, rtol=case.rtol, atol=case.atol)
        except Exception as exc:  # noqa: BLE001
            return f"fail: {_mismatch(exc)}"
    return "pass"


def forward_verdict(case) -> str:
    """bridge importer's verdict on ``case``: "pass", "unsupported" or "fail: <cause>"."""
    try:
        OnnxProgram(load_model(case.model))
    except UnsupportedOpError:
        return "unsupported"
    except Exception as exc:  # noqa: BLE001
        return f"fail: crash: {_short(exc)}"
    return _compare(case, run_bridge)


def onnxruntime_verdict(case) -> str:
    return _compare(case, run_onnxruntime)


def _is_float(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype in FLOAT_TYPES


def gradient_case(case) -> str | None:
    """None if ``case`` is a gradient case, else why not (the "n/a" reason).

    A gradient case has a float32/float64 tensor input, a float32/float64 tensor first output
    that is not empty and finite, no sequence input; its ``family`` is not in
    ``NOT_DIFFERENTIABLE`` (an expanded test may use Shape or Floor to compute sizes) and it is
    not one of ``NON_DIFFERENTIABLE_POINTS``.
    """
    feeds, expected = data_sets(case)[0]
    if case.name in NON_DIFFERENTIABLE_POINTS:
        return NON_DIFFERENTIABLE_POINTS[case.name]
    op = family(case.name, op_types(case.model))
    if op in NOT_DIFFERENTIABLE:
        return f"{op}: {NOT_DIFFERENTIABLE[op]}"
    if not any(_is_float(v) for v in feeds.values()):
        return "no floating-point input"
    if any(isinstance(v, list) for v in feeds.values()):
        return "sequence input"
    if not _is_float(expected[0]):
        return "first output not floating-point"
    if not expected[0].size or not np.all(np.isfinite(expected[0])):
        return "first output empty or not finite"
    return None


# Names the training graph gives its own inputs and outputs; bridge refuses a source that uses
# them (the nllloss/softmax-cross-entropy tests name an input "target" and an output "loss"), so
# the conformance run renames them first: it tests the ops, not the names.
CONTRACT_NAMES = ("target", "loss", "step", "lr")


def renamed(model: onnx.ModelProto, names: dict[str, str]) -> onnx.ModelProto:
    """``model`` with the values ``names`` (old -> new) renamed in the main graph."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
    for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        value.name = names.get(value.name, value.name)
    return result


def as_training_source(case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``bridge_source`` of ``case`` with every float input an initializer too (value from the
    first data set), and the remaining (integer, bool) inputs; values named like the training
    graph's own (``CONTRACT_NAMES``) get a ``source_`` prefix."""
    model, feeds = bridge_source(case.model, data_sets(case)[0][0])
    values = {v.name for v in [*model.graph.input, *model.graph.initializer]} | {o for n in model.graph.node for o in n.output}
    names = {n: f"source_{n}" for n in CONTRACT_NAMES if n in values}
    model, feeds = renamed(model, names), {names.get(k, k): v for k, v in feeds.items()}
    floats = {k: v for k, v in feeds.items() if _is_float(v)}
    return with_initializers(model, floats), {k: v for k, v in feeds.items() if k not in floats}


def trainable_inputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> list[str]:
    """The initializers of ``model`` (``as_training_source``) that reach its first output differentiably."""
    program = OnnxProgram(load_model(model))
    return differentiable_initializers(program, {k: _to_torch(v) for k, v in inputs.items()}, 0)


def gradient_verdict(case) -> str:
    """One training step of ``case`` against the float64 finite-difference oracle (at a kink,
    ``AT_KINKS``: against the float64 autograd of its torch twin)."""
    why_not = gradient_case(case)
    if why_not:
        return f"n/a: {why_not}"
    if case.name in NOT_RUN:
        return NOT_RUN[case.name]
    model, inputs = as_training_source(case)
    try:
        trainable = trainable_inputs(model, inputs)
    except Exception as exc:  # noqa: BLE001
        return f"fail: crash: {_short(exc)}"
    if not trainable:
        return "n/a: no input reaches the first output differentiably"
    try:
        result = check_training_step(model, inputs, trainable=trainable, fd_budget_s=FD_BUDGET_S,
                                     loss_rtol=LOSS_RTOL, twin=AT_KINKS.get(case.name))
    except Exception as exc:  # noqa: BLE001
        return f"fail: crash: {_short(exc)}"
    failures = result.failures()
    if not failures:
        return "pass"
    return "fail: " + "; ".join(sorted({f.split(": error")[0] for f in failures}))


ONNX_MLIR_TIMEOUT_S = 300.0  # a node test's training graph compiles in seconds


def onnx_mlir_verdict(name: str) -> str:
    """Test ``name``'s float32 training graph (the one ``gradient_verdict`` checks) compiled by onnx-mlir
    at its default flags and stepped once from the initial state, against onnxruntime's step (one thread)
    on the same graph, state and batch (``helpers.compiled.step_mismatches``, the op rows' tolerance):
    ``"pass"``, ``"fail: compile: <error>"``, ``"fail: step: <error>"``, ``"fail: mismatch: <outputs>"``,
    or ``"n/a: <why>"`` where there is no training graph to compile (no gradient case, no forward pass,
    a conversion that fails) or onnxruntime does not step it."""
    case = cases()[name]
    why_not = gradient_case(case)
    if why_not:
        return f"n/a: {why_not}"
    if case.name in NOT_RUN:
        return f"n/a: {NOT_RUN[case.name].removeprefix('fail: ')}"
    if forward_verdict(case) != "pass":
        return "n/a: forward does not pass"
    model, inputs = as_training_source(case)
    try:
        trainable = trainable_inputs(model, inputs)
        if not trainable:
            return "n/a: no input reaches the first output differentiably"
        tm = bridge.to_training_onnx(model, trainable=trainable, **OPTIONS)
    except Exception as exc:  # noqa: BLE001 - no training graph: nothing to compile
        return f"n/a: training graph not built: {_short(exc)}"
    target = np.random.default_rng(0).standard_normal(tm.target_shape).astype(tm.target_dtype)
    feed = {**inputs, **_random_noise(tm, inputs, 0)}
    try:
        want = tm.session(threads=1).step(feed, target)
    except Exception as exc:  # noqa: BLE001
        return f"n/a: onnxruntime does not step the graph: {_short(exc)}"
    try:
        compiled = bridge.compile(tm, backend="onnx-mlir", timeout=ONNX_MLIR_TIMEOUT_S)
    except CompileError as exc:
        return f"fail: compile: {_short(exc)}"
    try:
        got = compiled.session().step(feed, target)
    except Exception as exc:  # noqa: BLE001
        return f"fail: step: {_short(exc)}"
    off = step_mismatches(model, dict(OPTIONS, trainable=trainable), got, want, feed, target, name)
    return f"fail: mismatch: {', '.join(sorted(off))}" if off else "pass"


def wrong_gradient(verdict: str) -> bool:
    """Whether a gradient verdict records a wrong gradient: one that differs from finite differences
    (or, at a kink, from torch's), as opposed to a crash, a float32-noise or an onnx-mlir finding."""
    return verdict.startswith("fail") and ("vs finite differences" in verdict or "vs torch twin" in verdict)


def family(name: str, ops: Sequence[str]) -> str:
    """The op a test is about: its only op, else the longest op of onnx-mlir's table whose name
    starts the test's name (``test_layer_normalization_..._expanded`` -> LayerNormalization), else
    the name's first word (``test_nllloss_NC_expanded`` -> "nllloss (expanded)")."""
    if len(ops) == 1:
        return ops[0]
    key = name.removeprefix("test_").replace("_", "").lower()
    named = [op for op in MLIR_OPS if key.startswith(op.lower())]
    return max(named, key=len) if named else f"{name.removeprefix('test_').split('_')[0]} (expanded)"


def forward_verdicts(name: str) -> dict[str, Any]:
    """The ops and family of test ``name``, bridge's and onnxruntime's forward verdicts."""
    case = cases()[name]
    ops = op_types(case.model)
    return {"ops": ops, "family": family(name, ops), "forward": forward_verdict(case),
            "onnxruntime": onnxruntime_verdict(case)}


def grad_verdict(name: str, forward: str | None = None) -> str:
    """The gradient verdict of test ``name`` ("n/a" unless its ``forward`` verdict is "pass")."""
    case = cases()[name]
    if (forward or forward_verdict(case)) != "pass":
        return "n/a: forward does not pass"
    return gradient_verdict(case)


def verdicts(name: str, gradient: bool = True) -> dict[str, Any]:
    """Every verdict of test ``name`` (the gradient one only if ``gradient``)."""
    result = forward_verdicts(name)
    if gradient:
        result["grad"] = grad_verdict(name, result["forward"])
    return result


def load_expectations() -> dict[str, dict]:
    return json.loads(EXPECTATIONS.read_text()) if EXPECTATIONS.exists() else {}


def write_expectations(expectations: dict[str, dict]) -> None:
    EXPECTATIONS.write_text(json.dumps(dict(sorted(expectations.items())), indent=1, sort_keys=True) + "\n")


def main(argv: Sequence[str]) -> None:
    """Rewrite the expectations file from a full run, test by test (``--forward-only``: keep the
    gradient verdicts; ``--onnx-mlir``: only the onnx-mlir verdicts; ``--resume``: keep the entries
    that already have the verdicts asked for; test names: only these). The onnx-mlir verdicts are
    kept unless asked for."""
    expectations = load_expectations()
    only = [a for a in argv if not a.startswith("--")]
    asked = "onnx_mlir" if "--onnx-mlir" in argv else "grad"
    for index, name in enumerate(cases()):
        old = expectations.get(name, {})
        if ("--resume" in argv and asked in old) or (only and name not in only):
            continue
        if asked == "onnx_mlir":
            entry = {**old, "onnx_mlir": onnx_mlir_verdict(name)}
        else:
            entry = verdicts(name, gradient="--forward-only" not in argv)
            entry.setdefault("grad", old.get("grad"))
            entry.setdefault("onnx_mlir", old.get("onnx_mlir"))
        expectations[name] = entry
        write_expectations(expectations)
        print(f"{index} {name} {entry['forward']} | {entry['grad']} | {entry['onnx_mlir']}", flush=True)
    write_expectations({name: expectations[name] for name in cases()})


if __name__ == "__main__":
    main(sys.argv[1:])
