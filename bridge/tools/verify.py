"""``bridge.verify``: check a model's training graph against eager PyTorch, on the user's own model.

The model is converted with ``to_training_onnx`` and its first steps run in onnxruntime on
seeded random batches. The reference is independent of the training graph: the imported
program (``OnnxProgram``) run by eager torch autograd in float64, with the real torch loss and
the real ``torch.optim`` optimizer, on the same batches and the same Dropout noise.
Every output of the training graph (loss, ``grad_<w>``, ``updated_<x>``) is compared step by
step, and judged in units of torch's own float32 noise: the same reference is run in float32,
and a tensor passes when bridge's error is at most ``tolerance_factor`` times the float32
run's error (or a tiny floor). Errors are scale-relative: max abs error / max abs of the
float64 tensor. Float64 central finite differences of the step-1 loss on a sample of weight
elements check the reference's own gradients (the importer's converters under autograd), and
the imported program's forward is checked against onnxruntime running the source model itself
(the importer's converters' forward meaning, which the step comparison shares with the graph).
See docs/verify.md.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from ..api import _output_index, to_training_onnx
from ..contract import STEP, UPDATED_PREFIX, grad_name, slot_name, strip_prefix, updated_name
from ..errors import InvalidModelError, InvalidOptionError, positive_int
from ..onnx_file import all_nodes, read_model, subgraphs
from ..pipeline.importer.ops.random import RandomOpInEvalWarning
from ..pipeline.importer.program import OnnxProgram
from ..pipeline.importer.registry import buffer_inputs
from ..pipeline.load import batch_norm_mode, load_model
from ..pipeline.losses import _LOSSES, INDICES, Loss, _flatten_sequence, make_loss
from ..pipeline.optimizers import Optimizer, make_optimizer
from ..training.inference import inference_mode
from ..training.runtime import OrtGraph
from ..training.training_model import TrainingModel

JITTER = 2.0 ** -20  # relative jitter of the extra float32 runs: ~the float32 noise of deep activations
FD_STEP = 1e-6  # relative finite-difference step (of max(1, |w|)): float64 rounding and truncation both ~1e-10
_FLOAT = onnx.TensorProto.FLOAT
_DOUBLE = onnx.TensorProto.DOUBLE
_UNIT_TARGET_LOSSES = {"bce", "bce_with_logits", "kl_div"}  # targets are probabilities
FORWARD_PREFIX = "forward "  # rows of the forward check: the source model's outputs
_RANDOM_OPS = {"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli", "Multinomial"}


@dataclass(frozen=True)
class Row:
    """One checked tensor at one step.

    ``error``: bridge's max abs error / max abs of the float64 reference (for a
    finite-difference row: the float64 autograd gradient's error against the finite
    differences); ``noise``: the same measure for torch's float32 run (for a
    finite-difference row: the estimated rounding and truncation error of the differences);
    a row passes when ``error <= limit`` (never when the error is NaN or infinite).
    """

    name: str
    step: int
    error: float
    noise: float
    limit: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.limit

    @property
    def ratio(self) -> float:
        """The error in units of the noise."""
        if self.noise > 0:
            return self.error / self.noise
        return 0.0 if self.error == 0 else math.inf

    def __str__(self) -> str:
        return (f"{self.name:<44} {self.step:>4} {self.error:>10.3g} {self.noise:>10.3g} {self.ratio:>8.3g} "
                f"{self.limit:>10.3g}  {'OK' if self.passed else 'FAIL'}")


HEADER = f"{'tensor':<44} {'step':>4} {'error':>10} {'torch32':>10} {'ratio':>8} {'limit':>10}"


@dataclass
class VerifyReport:
    """The outcome of ``verify``: every row (tensor and step), and the figures of the run."""

    passed: bool
    rows: list[Row]
    steps: int
    tolerance_factor: float
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def failures(self) -> list[Row]:
        return [row for row in self.rows if not row.passed]

    def worst_rows(self) -> list[Row]:
        """One row per tensor: its step with the largest error / limit (a failing one first)."""
        worst: dict[str, Row] = {}
        for row in self.rows:
            held = worst.get(row.name)
            if held is None or _badness(row) > _badness(held):
                worst[row.name] = row
        return list(worst.values())

    def __str__(self) -> str:
        lines = [HEADER] + [str(row) for row in self.worst_rows()]
        tensors = len(self.worst_rows())
        if self.passed:
            best = max(self.rows, key=_badness)
            verdict = (f"PASS: {tensors} tensors over {self.steps} steps within {self.tolerance_factor:g}x torch's "
                       f"float32 noise (worst: {best.name} at step {best.step}, ratio {best.ratio:.3g})")
        else:
            names = ", ".join(sorted({row.name for row in self.failures}))
            verdict = f"FAIL: {len({r.name for r in self.failures})} of {tensors} tensors off: {names}"
        timing = ", ".join(f"{k} {v:.2f} s" for k, v in self.figures.items() if k.endswith("_s"))
        return "\n".join(lines + [f"time: {timing}", verdict])


def _badness(row: Row) -> float:
    return math.inf if not row.passed else (row.error / row.limit if row.limit > 0 else 0.0)


@dataclass(frozen=True)
class _Batch:
    inputs: dict[str, np.ndarray]
    noise: dict[str, np.ndarray]
    target: np.ndarray


def verify(
    model: str | os.PathLike | onnx.ModelProto,
    loss: str | Callable = "ce",
    optim: str | type[torch.optim.Optimizer] = "adam",
    *,
    loss_options: Mapping[str, Any] | None = None,
    optim_options: Mapping[str, Any] | None = None,
    steps: int = 3,
    batch_size: int | None = None,
    seed: int = 0,
    tolerance_factor: float = 10.0,
    floor: float = 1e-6,
    fd_per_weight: int = 8,
    fd_max: int = 16,
    noise_runs: int = 2,
    retry_runs: int = 6,
    inputs: Mapping[str, np.ndarray] | None = None,
    forward: bool = True,
    **convert_options: Any,
) -> VerifyReport:
    """Convert ``model`` and compare its first ``steps`` training steps with eager PyTorch.

    Args:
        model / loss / optim / loss_options / optim_options / batch_size: as ``to_training_onnx``;
            so are ``convert_options`` (``clip_grad_norm``, ``output``, ``trainable``,
            ``frozen``, ``dynamic_batch``, ``input_shapes``).
        steps: training steps to compare (each on a fresh random batch).
        seed: seeds the batches, targets and Dropout noise.
        tolerance_factor: K; a tensor passes when bridge's error <= max(K * torch32 noise, floor).
        floor: the smallest limit (scale-relative), for tensors whose float32 noise is zero.
        fd_per_weight / fd_max: weight elements checked by finite differences, per weight
            and in all (0 turns the check off).
        noise_runs: float32 reference runs with weights and inputs jittered (relative
            ``JITTER``), besides the plain one; torch's noise is the largest error among them.
        retry_runs: while some tensor fails, up to this many more jittered runs (a value within
            float32 noise of a ReLU's or max's kink flips in some runs only).
        inputs: data inputs to use at every step instead of random ones (e.g. a real
            attention mask), by name.
        forward: check the imported program's forward against onnxruntime running the source
            model on every step's batch (rows ``forward <output>``; see ``_forward_rows``).

    Returns a ``VerifyReport``; a mismatch is reported there, never raised. Raises a
    ``BridgeError`` for bad input or options.
    """
    _check_options(steps, tolerance_factor, floor, fd_per_weight, fd_max, noise_runs, retry_runs, forward)
    figures: dict[str, float] = {}
    start = time.perf_counter()
    tm = to_training_onnx(model, loss, optim, loss_options=loss_options, optim_options=optim_options,
                          batch_size=batch_size, **convert_options)
    figures["convert_s"] = time.perf_counter() - start
    source = load_model(model, buffer_inputs())
    frozen = batch_norm_mode(source, convert_options.get("batch_norm")) == "frozen"  # as the conversion reads it
    program32 = OnnxProgram(source, frozen_batch_norm=frozen)
    program64 = OnnxProgram(as_float64(source), frozen_batch_norm=frozen)
    loss_fn, optimizer = make_loss(loss, dict(loss_options or {})), make_optimizer(optim, dict(optim_options or {}))
    output_index = _output_index(program32.output_names, convert_options.get("output"))
    rng = np.random.default_rng(seed)
    unknown = sorted(set(inputs or {}) - set(tm.data_inputs))
    if unknown:
        raise InvalidOptionError(f"verify: inputs= names unknown inputs {unknown}; data inputs: {tm.data_inputs}")
    batches = _random_batches(tm, program32, loss_fn, output_index, steps, rng, batch_size, inputs or {})

    clock = time.perf_counter()
    session = tm.session(on_nonfinite="ignore")  # a NaN is a finding to report, not an error
    got = [session.step({**b.inputs, **b.noise}, b.target) for b in batches]
    figures["bridge_s"] = time.perf_counter() - clock

    clock = time.perf_counter()
    run = _Reference(tm, loss_fn, optimizer, output_index, convert_options.get("clip_grad_norm"))
    want = run.steps(program64, torch.float64, batches)
    singles = [run.steps(program32, torch.float32, batches)]
    singles += [run.steps(program32, torch.float32, batches, jitter=rng) for _ in range(noise_runs)]
    rows = _compare(got, want, singles, tolerance_factor, floor)
    for _ in range(retry_runs if noise_runs else 0):  # a kink one more jittered run may also flip
        if all(row.passed for row in rows):
            break
        singles.append(run.steps(program32, torch.float32, batches, jitter=rng))
        rows = _compare(got, want, singles, tolerance_factor, floor)
    figures["reference_s"] = time.perf_counter() - clock
    figures["float32_runs"] = len(singles)
    clock = time.perf_counter()
    rows += run.finite_differences(program64, batches[0], want[0], rng, fd_per_weight, fd_max, tolerance_factor, floor)
    figures["fd_s"] = time.perf_counter() - clock
    if forward:
        clock = time.perf_counter()
        forward_rng = np.random.default_rng([seed, 1])  # its own draws: the step rows do not depend on it
        rows = _forward_rows(model, run, program32, program64, batches, forward_rng, noise_runs, tolerance_factor,
                             floor) + rows
        figures["forward_s"] = time.perf_counter() - clock
    figures["total_s"] = time.perf_counter() - start
    figures["max_ratio"] = max((row.ratio for row in rows if row.noise > 0), default=0.0)
    return VerifyReport(all(row.passed for row in rows), rows, steps, tolerance_factor, figures)


def _check_options(steps: int, factor: float, floor: float, per_weight: int, cap: int, noise_runs: int,
                   retry_runs: int, forward: bool) -> None:
    positive_int(steps, "verify: steps")
    checks = {"tolerance_factor": (factor, factor > 0, "a positive number"),
              "floor": (floor, floor >= 0, "a number >= 0"),
              "fd_per_weight": (per_weight, isinstance(per_weight, int) and per_weight >= 0, "an int >= 0"),
              "fd_max": (cap, isinstance(cap, int) and cap >= 0, "an int >= 0"),
              "noise_runs": (noise_runs, isinstance(noise_runs, int) and noise_runs >= 0, "an int >= 0"),
              "retry_runs": (retry_runs, isinstance(retry_runs, int) and retry_runs >= 0, "an int >= 0"),
              "forward": (forward, isinstance(forward, bool), "True or False")}
    for name, (value, ok, what) in checks.items():
        if not ok:
            raise InvalidOptionError(f"verify: {name}={value!r} is not valid; give {what}")


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64, so that a reference run of it has no float32 step:
    float initializers, graph inputs and outputs, tensor attributes (``Constant``,
    ``ConstantOfShape``), ``value_float(s)`` constants, and every ``to``/``dtype``/``stash_type``
    that names float become double, in subgraphs too; value_info is dropped (shape inference
    redoes it). ``GroupNormalization``'s default ``stash_type`` (float32) is made explicit first.
    The one float64 converter of verify and of the test suite's oracles."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    _graph_to_float64(copy.graph)
    return copy


# Ops whose stash_type (the precision of the statistics) defaults to float32; onnx.reference's
# LayerNormalization computes at the input's precision and rejects stash_type=DOUBLE.
_STASHED = ("GroupNormalization",)
_FLOAT_TYPE_ATTRIBUTES = ("to", "dtype", "stash_type")


def _graph_to_float64(graph: onnx.GraphProto) -> None:
    del graph.value_info[:]
    for index, init in enumerate(graph.initializer):
        if init.data_type == _FLOAT:
            graph.initializer[index].CopyFrom(_tensor_to_float64(init))
    for value in list(graph.input) + list(graph.output):
        if value.type.tensor_type.elem_type == _FLOAT:
            value.type.tensor_type.elem_type = _DOUBLE
    for node in graph.node:
        if node.op_type in _STASHED and not any(a.name == "stash_type" for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("stash_type", _FLOAT))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == _FLOAT:
                attribute.t.CopyFrom(_tensor_to_float64(attribute.t))
            elif attribute.type == onnx.AttributeProto.INT and attribute.name in _FLOAT_TYPE_ATTRIBUTES \
                    and attribute.i == _FLOAT:
                attribute.i = _DOUBLE
        for sub in subgraphs(node):
            _graph_to_float64(sub)
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name in ("value_float", "value_floats"):
            value = onnx.helper.get_attribute_value(node.attribute[0])  # float32 by definition
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("value", onnx.numpy_helper.from_array(
                np.asarray(value, dtype=np.float64))))


def _tensor_to_float64(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


# --- batches --------------------------------------------------------------------------------

def _random_batches(tm: TrainingModel, program: OnnxProgram, loss_fn: Loss, output_index: int, count: int,
                    rng: np.random.Generator, batch_size: int | None,
                    given: Mapping[str, np.ndarray]) -> list[_Batch]:
    """Seeded inputs with the training graph's shapes and dtypes (``given`` ones as they are;
    integer indices into an embedding in its range; other integer inputs, such as attention
    masks, all ones), targets the loss accepts, and uniform [0, 1) noise for every random
    input (Dropout)."""
    graph_inputs = {value.name: value for value in tm.model.graph.input}
    batch = tm.target_shape[0] if tm.target_shape else (batch_size or 2)
    bounds = _index_bounds(program)

    def shape_of(name: str) -> list[int]:
        dims = graph_inputs[name].type.tensor_type.shape.dim
        return [d.dim_value if d.HasField("dim_value") else batch for d in dims]

    def dtype_of(name: str) -> np.dtype:
        return onnx.helper.tensor_dtype_to_np_dtype(graph_inputs[name].type.tensor_type.elem_type)

    batches = []
    classes = None
    for _ in range(count):
        inputs = {}
        for name in tm.data_inputs:
            dtype = dtype_of(name)
            if name in given:
                inputs[name] = np.asarray(given[name])
            elif name in bounds:
                inputs[name] = rng.integers(0, bounds[name], shape_of(name)).astype(dtype)
            elif np.issubdtype(dtype, np.integer) or dtype == np.bool_:
                inputs[name] = np.ones(shape_of(name), dtype)  # masks and flags: all on
            else:
                inputs[name] = rng.standard_normal(shape_of(name)).astype(dtype)
        if classes is None:
            classes = _class_count(program, inputs, output_index, tm.target_shape)
        noise = {name: rng.random(shape_of(name)).astype(dtype_of(name)) for name in tm.signature.random}
        batches.append(_Batch(inputs, noise, _random_target(tm, loss_fn, classes, rng)))
    return batches


_SHAPE_ONLY = {"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Transpose", "Expand", "Cast"}


def _index_bounds(program: OnnxProgram) -> dict[str, int]:
    """Data inputs used (through shape-only ops) as Gather indices into an initializer
    (embeddings): the smallest row count."""
    source = {name: name for name in program.input_names}  # value -> the data input it reshapes
    bounds: dict[str, int] = {}
    for node in program.graph.node:
        if node.op_type in _SHAPE_ONLY and node.input and node.input[0] in source:
            source[node.output[0]] = source[node.input[0]]
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] in source:
            table = program.initializers.get(node.input[0])
            if table is not None:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                name = source[node.input[1]]
                bounds[name] = min(bounds.get(name, table.shape[axis]), table.shape[axis])
    return bounds


def _class_count(program: OnnxProgram, inputs: dict[str, np.ndarray], output_index: int,
                 target_shape: tuple[int, ...]) -> int:
    """The class dim of the model output (what class-index targets index)."""
    with torch.no_grad():
        outputs, _ = program.run({k: torch.from_numpy(v) for k, v in inputs.items()}, {}, training=False)
    shape = tuple(outputs[output_index].shape)
    if len(shape) == 3 and len(target_shape) == 2:
        return shape[-1]
    return shape[1] if len(shape) > 1 else shape[0]


def _random_target(tm: TrainingModel, loss_fn: Loss, classes: int, rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(tm.target_dtype, np.integer):
        return rng.integers(0, classes, tm.target_shape).astype(tm.target_dtype)
    if loss_fn.name in _UNIT_TARGET_LOSSES or (loss_fn.name == "ce" and loss_fn.label_format != INDICES):
        return rng.random(tm.target_shape).astype(tm.target_dtype)
    return rng.standard_normal(tm.target_shape).astype(tm.target_dtype)


# --- the eager reference ----------------------------------------------------------------------

class _Reference:
    """Eager steps of the imported program under torch autograd, torch loss and torch.optim."""

    def __init__(self, tm: TrainingModel, loss_fn: Loss, optimizer: Optimizer, output_index: int,
                 max_grad_norm: float | None):
        self.tm = tm
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.output_index = output_index
        self.max_grad_norm = max_grad_norm

    def _state(self, dtype: torch.dtype, jitter: np.random.Generator | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        initial = {name: _jittered(value, jitter) for name, value in self.tm.initial_state().items()}
        weights = {w: torch.from_numpy(initial[w]).to(dtype) for w in self.tm.weights}
        buffers = {b: torch.from_numpy(initial[b]).to(dtype) for b in self.tm.signature.buffers}
        return weights, buffers

    def _loss(self, program: OnnxProgram, dtype: torch.dtype, batch: _Batch, tensors: dict) -> tuple[torch.Tensor, dict]:
        inputs = {k: _to_torch(v, dtype) for k, v in batch.inputs.items()}
        noise = {k: _to_torch(v, dtype) for k, v in batch.noise.items()}
        outputs, updated = program.run(inputs, tensors, training=True, random=noise)
        return torch_loss(self.loss_fn, dtype)(outputs[self.output_index], _to_torch(batch.target, dtype)), updated

    def steps(self, program: OnnxProgram, dtype: torch.dtype, batches: list[_Batch],
              jitter: np.random.Generator | None = None) -> list[dict[str, np.ndarray]]:
        """Per step: loss, grad_<w> (unclipped) and every updated_<x> the training graph outputs.

        With ``jitter``, every float weight, buffer and input is first moved by up to ``JITTER``
        (relative): the spread such runs show is what float32 cannot decide (a ReLU input or a
        max within float32 noise of a kink, which one run may decide by luck).
        """
        weights, buffers = self._state(dtype, jitter)
        batches = [_Batch({k: _jittered(v, jitter) for k, v in b.inputs.items()}, b.noise, b.target) for b in batches]
        params = {name: torch.nn.Parameter(value) for name, value in weights.items()}
        opt = self.optimizer.rule.torch_class(list(params.values()), **self.optimizer.options, foreach=False)
        records = []
        for index, batch in enumerate(batches, start=1):
            opt.zero_grad()
            value, updated = self._loss(program, dtype, batch, {**params, **buffers})
            value.backward()
            for p in params.values():
                if p.grad is None:  # bridge materialises the gradient of an unused weight as zeros
                    p.grad = torch.zeros_like(p)
            record = {"loss": _to_numpy(value)}
            record.update({grad_name(n): _to_numpy(p.grad) for n, p in params.items()})
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(params.values()), self.max_grad_norm, foreach=False)
            opt.step()
            buffers.update({name: updated[name].detach() for name in buffers if name in updated})
            record.update({updated_name(n): _to_numpy(p) for n, p in params.items()})
            record.update({updated_name(n): _to_numpy(b) for n, b in buffers.items()})
            for weight, slot in self.tm.signature.state:
                record[updated_name(slot_name(weight, slot))] = _to_numpy(opt.state[params[weight]][slot])
            record[updated_name(STEP)] = np.asarray(float(index))
            records.append(record)
        return records

    def forwards(self, program: OnnxProgram, dtype: torch.dtype, batches: list[_Batch],
                 jitter: np.random.Generator | None = None) -> list[dict[str, np.ndarray]]:
        """Per batch: every output of ``program`` in ONNX's inference meaning (``training=False``:
        Dropout off, a BatchNormalization's running statistics unless the node asks for batch ones),
        named ``forward <output>``; the initial weights, and ``jitter`` as in ``steps``."""
        weights, buffers = self._state(dtype, jitter)
        records = []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RandomOpInEvalWarning)  # outputs of random ops are not compared
            for batch in batches:
                inputs = {k: _to_torch(_jittered(v, jitter), dtype) for k, v in batch.inputs.items()}
                outputs, _ = program.run(inputs, {**weights, **buffers}, training=False)
                records.append({FORWARD_PREFIX + n: _to_numpy(o) for n, o in zip(program.output_names, outputs, strict=True)})
        return records

    def finite_differences(self, program: OnnxProgram, batch: _Batch, record: dict[str, np.ndarray],
                           rng: np.random.Generator, per_weight: int, cap: int, factor: float, floor: float) -> list[Row]:
        """Central differences of the step-1 loss (float64) at sampled elements vs ``grad_<w>``."""
        weights, buffers = self._state(torch.float64)
        tensors = {**weights, **buffers}
        chosen = _sample_elements(weights, rng, per_weight, cap)
        rows = []
        with torch.no_grad():
            for name, elements in chosen.items():
                flat, grad = weights[name].view(-1), record[grad_name(name)].reshape(-1)
                scale = float(np.max(np.abs(grad))) or 1.0
                error = noise = 0.0
                for element in elements:
                    original = float(flat[element])
                    h = FD_STEP * max(1.0, abs(original))
                    values = {}
                    for delta in (h, -h, 2 * h, -2 * h):
                        flat[element] = original + delta
                        values[delta] = float(self._loss(program, torch.float64, batch, tensors)[0])
                    flat[element] = original
                    difference = (values[h] - values[-h]) / (2 * h)
                    error = max(error, abs(difference - float(grad[element])) / scale)
                    rounding = 8 * np.finfo(np.float64).eps * max(abs(v) for v in values.values()) / h
                    # measured: a kink (ReLU, max) within 2h makes the two step sizes disagree
                    wide = (values[2 * h] - values[-2 * h]) / (4 * h)
                    noise = max(noise, (rounding + h * h * abs(difference) + abs(wide - difference)) / scale)
                rows.append(Row(f"fd grad_{name}", 1, error, noise, max(factor * noise, floor)))
        return rows


def torch_loss(loss_fn: Loss, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The torch.nn.functional loss that ``loss_fn`` names, with its options (float ones in ``dtype``);
    a callable loss is the user's own function."""
    entry = _LOSSES.get(loss_fn.name)
    if entry is None or entry.fn is not loss_fn.fn:
        return loss_fn
    options = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in loss_fn.options.items()}
    if loss_fn.name in ("ce", "nll"):
        return lambda output, target: entry.signature(*_flatten_sequence(output, target), **options)
    return lambda output, target: entry.signature(output, target, **options)


def _sample_elements(weights: Mapping[str, torch.Tensor], rng: np.random.Generator, per_weight: int,
                     cap: int) -> dict[str, list[int]]:
    """``per_weight`` random elements of each weight, at most ``cap`` in all (then spread over
    a random subset of weights, at least one element each)."""
    names = list(weights)
    if not per_weight or not cap or not names:
        return {}
    if len(names) * per_weight > cap:
        per_weight = max(1, cap // len(names))
        if len(names) > cap:
            names = [names[i] for i in sorted(rng.choice(len(names), cap, replace=False))]
    return {name: sorted(int(i) for i in rng.choice(weights[name].numel(), min(per_weight, weights[name].numel()),
                                                     replace=False)) for name in names}


def _jittered(value: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """``value`` times ``1 + u * 2**-24``, ``u`` uniform in [-1, 1] per element (floats only)."""
    if rng is None or not np.issubdtype(value.dtype, np.floating):
        return value
    return (value * (1 + rng.uniform(-1, 1, value.shape) * JITTER)).astype(value.dtype)


def _to_torch(value: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(value, copy=True))
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _to_numpy(value: torch.Tensor) -> np.ndarray:
    return value.detach().numpy().copy()


# --- the forward against onnxruntime ----------------------------------------------------------

def _forward_rows(model: str | os.PathLike | onnx.ModelProto, run: _Reference, program32: OnnxProgram,
                  program64: OnnxProgram, batches: list[_Batch], rng: np.random.Generator, noise_runs: int,
                  factor: float, floor: float) -> list[Row]:
    """Rows ``forward <output>`` per batch: onnxruntime running the source model (as the user gave
    it, not bridge's loaded copy; ``_source_forward``) against the imported program in float64, judged in units of
    the float32 program's own error (plain and ``noise_runs`` jittered runs), as the step rows are.

    The step comparison cannot see a converter's wrong forward meaning: the training graph and the
    reference both run it. onnxruntime knows nothing of bridge. Outputs that depend on a random op
    are left out (onnxruntime draws its own values); Dropout runs as inference (identity) on both
    sides, its training behaviour being checked by the step rows (shared noise)."""
    got = _source_forward(model, program32, batches)
    want = run.forwards(program64, torch.float64, batches)
    singles = [run.forwards(program32, torch.float32, batches)]
    singles += [run.forwards(program32, torch.float32, batches, jitter=rng) for _ in range(noise_runs)]
    return _compare(got, want, singles, factor, floor)


def _source_forward(model: str | os.PathLike | onnx.ModelProto, program: OnnxProgram,
                    batches: list[_Batch]) -> list[dict[str, np.ndarray]]:
    """Per batch, the source model's deterministic outputs, named ``forward <output>``: run by
    onnxruntime, or by ONNX's reference evaluator (``onnx.reference``) where onnxruntime has no kernel
    for the model (a batch-major GRU). Neither knows anything of bridge. A program with frozen BatchNorms
    is compared with the source's BatchNorms in inference mode (``inference_mode``), which is their meaning then."""
    source = read_model(model)
    if program.frozen_batch_norm:  # on a copy: the caller's model stays as given
        frozen = onnx.ModelProto()
        frozen.CopyFrom(source)
        inference_mode(frozen)
        source = frozen
    source = _dropout_off(source)
    random = _random_outputs(source.graph)
    feeds = [{**program.initializers, **batch.inputs} for batch in batches]  # initializers: old models list them as inputs
    try:
        graph = OrtGraph(source)
        runs = [graph(feed) for feed in feeds]
    except Exception as ort_error:  # onnxruntime raises its own types for missing kernels
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(source)
            runs = [dict(zip(evaluator.output_names, evaluator.run(None, {n: feed[n] for n in evaluator.input_names}),
                             strict=True)) for feed in feeds]
        except Exception as exc:
            raise InvalidModelError(
                f"verify: neither onnxruntime ({type(ort_error).__name__}: {ort_error}) nor ONNX's reference "
                f"evaluator ({type(exc).__name__}: {exc}) runs the source model, so the imported forward cannot "
                "be checked against it; pass forward=False to bridge.verify to skip that check") from exc
    return [{FORWARD_PREFIX + name: np.asarray(value) for name, value in outputs.items() if name not in random}
            for outputs in runs]


def _dropout_off(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose Dropout nodes get ``training_mode`` false (a train-mode export sets
    it true, and onnxruntime would drop units at random)."""
    def switched(node: onnx.NodeProto) -> bool:
        return node.op_type == "Dropout" and len(node.input) > 2 and bool(node.input[2])

    if not any(switched(node) for node in all_nodes(model.graph)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    off = "bridge.verify.training_mode_off"
    copy.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(False), off))
    for node in all_nodes(copy.graph):
        if switched(node):
            node.input[2] = off
    return copy


def _random_outputs(graph: onnx.GraphProto) -> set[str]:
    """The graph outputs computed from a random op (also one inside a subgraph)."""
    drawn: set[str] = set()
    for node in graph.node:
        nodes = [node] + [n for sub in subgraphs(node) for n in all_nodes(sub)]  # reading outer values by name
        if any(n.op_type in _RANDOM_OPS or drawn.intersection(n.input) for n in nodes):
            drawn.update(node.output)
    return {value.name for value in graph.output if value.name in drawn}


# --- comparison -----------------------------------------------------------------------------

def scale_of(array: np.ndarray) -> float:
    """A tensor's scale: its largest finite magnitude (0 when it has none). Errors are judged
    against it, here and in the test suite: float32 noise in an element near zero is judged
    against the tensor, not against that element."""
    array = np.asarray(array, np.float64)
    finite = array[np.isfinite(array)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def scaled_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / ``scale_of(expected)`` over the finite elements of ``expected``
    (absolute when ``expected`` is all zero); infinite when shapes differ or ``actual`` is
    NaN/inf where ``expected`` is finite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return math.inf
    finite = np.isfinite(expected)
    if np.any(~np.isfinite(actual[finite])):
        return math.inf
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(actual[finite] - expected[finite]))) / (scale_of(expected) or 1.0)


def _compare(got: list[dict], want: list[dict], singles: list[list[dict]], factor: float, floor: float) -> list[Row]:
    """Rows for every output at every step: bridge's error against the float64 reference,
    judged against torch float32's own error, the largest over the float32 runs (see ``_limit``)."""
    rows = []
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        noise = {name: max(scaled_error(run[step - 1][name], w[name]) for run in singles) for name in w}
        for name in g:  # the training graph's output order
            if name not in w:
                rows.append(Row(name, step, math.inf, 0.0, 0.0))  # an output the reference cannot explain
                continue
            gradient = _gradient_of(name, w)
            limit = _limit(noise[name], noise[gradient] if gradient else 0.0, factor, floor)
            rows.append(Row(name, step, scaled_error(g[name], w[name]), noise[name], limit))
    return rows


def _limit(noise: float, gradient_noise: float, factor: float, floor: float) -> float:
    """``max(K * noise, floor)``; an updated weight or optimizer state may also be off by what a
    gradient ``K`` times noisier than torch's gives once squared (Adam's ``exp_avg_sq``):
    ``(1 + K * gradient_noise)**2 - 1``. One float32 run can be lucky on a derived tensor, and
    for a gradient that is zero in theory (a key bias in attention) squaring squares the ratio
    of two noises."""
    return max(factor * noise, (1 + factor * gradient_noise) ** 2 - 1, floor)


def _gradient_of(name: str, record: Mapping[str, np.ndarray]) -> str | None:
    """The gradient that ``updated_<w>`` or ``updated_<w>.<slot>`` is computed from, if any."""
    if not name.startswith(UPDATED_PREFIX):
        return None
    rest = strip_prefix(name, UPDATED_PREFIX)
    for weight in (rest, rest.rpartition(".")[0]):
        if grad_name(weight) in record:
            return grad_name(weight)
    return None
