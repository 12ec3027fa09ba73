"""Stage 7, runtime: run training steps of a training ONNX model in onnxruntime.

``StepSession`` keeps the state (weights, buffers, optimizer state, ``step``, ``lr``),
feeds it with a batch, and feeds every ``updated_<x>`` output back as ``<x>``; a backend
only says how to run one step (``TrainingSession``: onnxruntime; ``bridge.training.runtime_iree``: IREE).

Before a step the batch is checked (``bridge.training.feed_checks.StepChecks``: names, dtypes, shapes,
NaN/inf, class indices); after it, a non-finite loss or updated value raises
``NonFiniteError`` with the state unchanged, unless ``on_nonfinite`` is ``"skip"`` (state
unchanged, ``skipped_steps`` counts it) or ``"ignore"`` (the values are kept).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import onnx

from ..contract import (
    DIM_BOUNDS,
    GRAD_PREFIX,
    LOSS_OPTIONS,
    MEMORY,
    OUTPUT_PREFIX,
    PRECISION,
    UPDATED_PREFIX,
    decode_random_inputs,
    props,
    strip_prefix,
    updated_name,
)
from ..errors import BridgeError, InvalidOptionError, ModelLoadError, positive_int
from ..onnx_file import external_copy, is_large, model_digest, read_model
from .feed_checks import NonFiniteError, StepChecks, StepInputError, check_policy, covered_outputs, nonfinite_outputs
from .piecewise import LoadedPiece, PiecewiseStep

if TYPE_CHECKING:
    import onnxruntime

# a noise input's (shape, dtype); a dim is an int, a dim name or expression (``seq``, ``batch*seq``), or None: the batch
NoiseSpec = tuple[list[int | str | None], np.dtype]


class StepSession(ABC):
    """Training state plus ``step(inputs, target)``; subclasses implement ``_run``.

    ``graph_hash`` identifies the training graph (sha256 of the ONNX model), so a checkpoint
    is only loaded into a session of the graph that wrote it.
    """

    input_names: list[str]  # the step graph's inputs and outputs, set by each backend's session
    output_names: list[str]

    def __init__(self, state: Mapping[str, np.ndarray], seed: int | None = None, *,
                 checks: StepChecks | None = None, on_nonfinite: str = "raise", graph_hash: str = "",
                 eval_model: onnx.ModelProto | None = None, covered: frozenset[str] = frozenset()):
        self.state = {name: np.asarray(value) for name, value in state.items()}
        self.random_inputs: dict[str, NoiseSpec] = {}
        self.dim_bounds: dict[str, int] = {}  # the largest size of a symbolic dim the graph holds for
        self._rng = np.random.default_rng(seed)
        self.checks = checks
        self.on_nonfinite = check_policy(on_nonfinite)
        self.skipped_steps = 0
        self.graph_hash = graph_hash
        self.eval_graph = None if eval_model is None else EvalGraph(eval_model)
        self.split_step: SplitStep | None = None
        self.covered_outputs = covered  # skipped by the non-finite check (feed_checks.covered_outputs)
        self.in_place: list[str] = []  # the state a step replaces in its own memory (bridge.compile(in_place=True))

    @property
    def lr(self) -> float:
        return float(self.state["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.state["lr"] = np.asarray(value, dtype=self.state["lr"].dtype)

    def step(self, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict[str, np.ndarray]:
        """Run one training step; returns every output (loss, grad_*, updated_*, output_*)."""
        if self.checks is not None:
            self.checks.check(inputs, target)
        feed = {**self.state, **self._noise(self.random_inputs, self.checks, inputs, target), **inputs, "target": target}
        return self._commit(self._run(feed))

    def enable_accumulation(self, gradient_model: onnx.ModelProto, update_model: onnx.ModelProto,
                            providers=None) -> None:
        """Load the step's two halves (``TrainingModel.gradient_model`` / ``update_model``, run in
        onnxruntime on this session's state) so that ``accumulate`` can run."""
        self.split_step = SplitStep(gradient_model, update_model, providers)

    def accumulate(self, micro_batches: list[tuple[Mapping[str, np.ndarray], np.ndarray]],
                   reduce: Callable[[dict[str, np.ndarray], int], dict[str, np.ndarray]] | None = None
                   ) -> dict[str, np.ndarray]:
        """One optimizer step on the effective batch made of ``micro_batches`` (``(inputs, target)``
        pairs): the gradient graph on each, gradients and loss averaged weighted by micro-batch size
        (1 for a sum-reduced loss), then the update graph once (clipping included). Buffers (BatchNorm
        statistics) are updated per micro-batch, as torch does with accumulation. Returns ``loss``,
        ``grad_*`` (accumulated), ``updated_*`` and ``output_*`` (micro-batches concatenated); the
        state is committed, or not, as for ``step`` (``on_nonfinite``).

        ``reduce`` (data-parallel training, ``bridge.training.distributed``) maps the float64 ``loss`` and
        ``grad_*`` averaged over these micro-batches, and their sample count, to the values of the
        whole (all-ranks) batch, before the update graph runs."""
        if self.split_step is None:
            raise BridgeError(f"this {type(self).__name__} has no gradient/update graphs: call "
                              "enable_accumulation(tm.gradient_model, tm.update_model) first")
        if not micro_batches:
            raise BridgeError("accumulate needs at least one micro-batch")
        graph = self.split_step
        total = sum(len(target) for _, target in micro_batches)
        buffers = {name: self.state[name] for name in graph.buffers}
        sums: dict[str, np.ndarray] = {}
        outputs: dict[str, list[np.ndarray]] = {}
        for inputs, target in micro_batches:
            graph.checks.check(inputs, target)
            feed = {**self.state, **buffers, **self._noise(graph.random_inputs, graph.checks, inputs, target),
                    **inputs, "target": target}
            results = graph.gradient(feed)
            weight = len(target) / total if graph.mean_loss else 1.0
            for name in ["loss"] + graph.gradients:
                sums[name] = sums.get(name, 0.0) + weight * results[name].astype(np.float64)
            buffers.update({name: results[updated_name(name)] for name in graph.buffers})
            for name in (n for n in results if n.startswith(OUTPUT_PREFIX)):
                outputs.setdefault(name, []).append(results[name])
        if reduce is not None:
            sums = reduce(sums, total)
        grads = {name: sums[name].astype(self.state[strip_prefix(name, GRAD_PREFIX)].dtype) for name in graph.gradients}
        results = graph.update({**self.state, **grads})
        results.update({updated_name(name): value for name, value in buffers.items()})
        results.update({"loss": np.asarray(sums["loss"], dtype=graph.loss_dtype), **grads})
        results.update({name: np.concatenate(parts) for name, parts in outputs.items()})
        return self._commit(results)

    def _noise(self, random_inputs: Mapping[str, NoiseSpec], checks: StepChecks | None,
               inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict[str, np.ndarray]:
        """Uniform [0, 1) noise of random ops (e.g. Dropout), fresh each step, for the noise inputs
        that ``inputs`` does not give, shaped from the batch: a symbolic dim of a noise input (its
        name, or an expression of names) takes the size that dim has in ``inputs`` and ``target``;
        None is the batch (the target's length)."""
        sizes = self._dim_sizes(checks, inputs, target)
        sizes.setdefault(None, _batch(target))
        return {name: self._rng.random([_size(d, sizes, name) for d in shape]).astype(dtype)
                for name, (shape, dtype) in random_inputs.items() if name not in inputs}

    def _dim_sizes(self, checks: StepChecks | None, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict:
        """The size of every named (symbolic) dim in this batch (by the graph's declared shapes,
        ``checks``), each within the largest size the graph holds for (``dim_bounds``)."""
        feed = {**inputs, "target": target}
        sizes = {}
        for name, (shape, _) in ({} if checks is None else checks.specs).items():
            value = feed.get(name)
            if value is not None and np.ndim(value) == len(shape):
                sizes.update({dim: size for dim, size in zip(shape, np.shape(value), strict=True) if isinstance(dim, str)})
        for dim, bound in self.dim_bounds.items():
            if sizes.get(dim, 0) > bound:
                raise StepInputError(f"dim '{dim}' is {sizes[dim]} in this batch, but the model holds for sizes up to "
                                     f"{bound} only (its graph slices a constant of that length, e.g. a position table)")
        return sizes

    def _set_in_place(self, names: list[str]) -> None:
        """Declare the state ``names`` that each step replaces in its own memory: the previous step's values of
        them are gone after a step, so ``on_nonfinite="skip"`` is refused."""
        self.in_place = names
        if names and self.on_nonfinite == "skip":
            raise InvalidOptionError("on_nonfinite='skip' cannot keep the state of this module: it updates "
                                     f"{len(names)} state arrays in place (bridge.compile(in_place=True)); "
                                     "compile without in_place, or use on_nonfinite='raise'")

    def _commit(self, results: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Feed ``updated_*`` back into the state, unless the loss or an update is not finite
        (then as ``on_nonfinite`` says; the state updated in place holds the step's values)."""
        updated = [name for name in results if name.startswith(UPDATED_PREFIX)]
        checked = ["loss"] + [name for name in updated if name not in self.covered_outputs]
        bad = nonfinite_outputs(results, checked) if self.on_nonfinite != "ignore" else []
        if bad:
            if self.on_nonfinite == "raise":
                message = f"step {int(self.state.get('step', 0))} produced NaN/inf in {bad}; the state is unchanged"
                if not self.in_place:
                    raise NonFiniteError(f"{message} (lower the lr, clip gradients, or on_nonfinite='skip')")
                self.state.update({name: results[updated_name(name)] for name in self.in_place})
                raise NonFiniteError(f"{message}, except the state this module updates in place ({len(self.in_place)} "
                                     "arrays, bridge.compile(in_place=True)), which holds this step's values: restore "
                                     "it from a checkpoint (and lower the lr or clip gradients)")
            self.skipped_steps += 1
            return results
        for name in updated:
            self.state[strip_prefix(name, UPDATED_PREFIX)] = results[name]
        return results

    def save_checkpoint(self, path: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> Path:
        """Write the state, the noise generator and ``extra`` (JSON-able) atomically to an ``.npz``."""
        from .checkpoint import write_checkpoint

        meta = {"graph_hash": self.graph_hash, "rng": self._rng.bit_generator.state,
                "skipped_steps": self.skipped_steps, "extra": dict(extra or {})}
        return write_checkpoint(path, self.state, meta)

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote (refused for another graph); returns its ``extra``."""
        from .checkpoint import read_checkpoint

        state, meta = read_checkpoint(path, self.graph_hash, set(self.state))
        self.state = state
        self._rng.bit_generator.state = meta["rng"]
        self.skipped_steps = meta["skipped_steps"]
        return meta["extra"]

    def evaluate(self, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict[str, np.ndarray]:
        """Run the eval graph (inference-mode forward + loss, in onnxruntime) on the current weights
        and buffers: ``loss`` and ``output_<name>`` for every model output."""
        if self.eval_graph is None:
            raise BridgeError(f"this {type(self).__name__} has no eval graph: create it with "
                              "eval_model=TrainingModel.eval_model (TrainingModel.session() does)")
        return self.eval_graph(self.state, inputs, target)

    @abstractmethod
    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the training graph on ``feed`` (every graph input by name); outputs by name."""


def graph_hash(model: onnx.ModelProto | bytes) -> str:
    """The identity of a training graph: sha256 of its serialized ONNX model."""
    return model_digest(model) if isinstance(model, onnx.ModelProto) else hashlib.sha256(model).hexdigest()


def compiled_module(module: bytes | str | os.PathLike, kind: str) -> tuple[bytes, str]:
    """A compiled module given as bytes or as the path of its file: its bytes and where they came from (the
    file's resolved path, or ``the <kind>``); ``ModelLoadError`` naming ``kind`` and the path where there is no file."""
    if isinstance(module, bytes):
        return module, f"the {kind}"
    path = Path(module).resolve()
    if not path.is_file():
        raise ModelLoadError(f"no such {kind}: {path}")
    return path.read_bytes(), str(path)


def compiled_identity(module: bytes, training_model: onnx.ModelProto | None) -> dict[str, Any]:
    """``StepSession``'s ``checks``, ``graph_hash`` and ``covered`` outputs for a session of the compiled ``module``:
    those of ``training_model``, the ONNX graph it was compiled from (checkpoints then interchange with the other
    backends' sessions of that graph), else no batch checks, the module's own hash and every output checked."""
    if training_model is None:
        return {"checks": None, "graph_hash": graph_hash(module)}
    return {"checks": StepChecks.from_model(training_model), "graph_hash": graph_hash(training_model),
            "covered": covered_outputs(training_model)}


def unchecked_run(session) -> Callable:
    """``session.run`` without InferenceSession.run's Python re-validation of the feed (a lookup per
    input, a noticeable part of a small model's step): onnxruntime's private binding, whose ``run``
    takes the public method's positional arguments. bridge's feeds hold every input by construction.
    Falls back to the public method where a release of onnxruntime lacks the binding."""
    run = getattr(getattr(session, "_sess", None), "run", None)
    return run if callable(run) else session.run


def session_options(threads: int | None = None, spinning: bool = True) -> onnxruntime.SessionOptions:
    """bridge's onnxruntime session options: BASIC graph optimizations; ``threads`` intra-op threads
    (default: onnxruntime's own, one per physical core); ``spinning=False``: they block instead of
    spinning between the parallel parts of a step. Spinning (onnxruntime's default) is faster on
    cores of one's own; on cores shared with other busy processes a spinning worker holds its core
    for the whole step, so pass ``spinning=False`` there.

    Without onnxruntime's memory pattern, each intermediate value is allocated when it is computed and
    freed after its last reader; the pattern instead lays every value of the step out in one block planned
    from its first run, which can hold more than the values alive at once. Nor does a value take over the
    buffer of an earlier one of its size (onnxruntime's buffer reuse): a buffer so shared stays allocated
    from its first value to its last one's last reader, idle in between, and a step's buffers then outnumber
    its values alive at once. The nodes keep onnxruntime's default order (depth first back from the outputs),
    which runs a weight's update soon after its gradient: the file's order (torch's) keeps every gradient alive
    until the optimizer at its end."""
    import onnxruntime as ort

    threads = positive_int(threads, "threads", "onnxruntime's default (one per physical core)")
    if not isinstance(spinning, bool):
        raise InvalidOptionError(f"spinning={spinning!r} is not valid; give True or False")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.enable_mem_pattern = False
    options.enable_mem_reuse = False
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        options.intra_op_num_threads = threads
    return options


@contextlib.contextmanager
def outputs_dropped(model: onnx.ModelProto, dropped: Callable[[str], bool] | None) -> Iterator[onnx.ModelProto]:
    """``model`` without the graph outputs whose names ``dropped`` picks, for the time of the ``with``
    (a session built from it); the outputs are restored after, and the model is not copied."""
    outputs = list(model.graph.output)
    if dropped is not None:
        del model.graph.output[:]
        model.graph.output.extend(o for o in outputs if not dropped(o.name))
    try:
        yield model
    finally:
        if dropped is not None:
            del model.graph.output[:]
            model.graph.output.extend(outputs)


@contextlib.contextmanager
def _kernels_checked() -> Iterator[None]:
    """onnxruntime's refusal of a node it has no kernel for (a bfloat16 graph converted with ``target="plain"``)
    as a ``BridgeError`` that names the node and the fix."""
    import onnxruntime as ort

    try:
        yield
    except ort.capi.onnxruntime_pybind11_state.NotImplemented as exc:
        raise BridgeError(f"onnxruntime has no CPU kernel for a node of this graph ({exc}); for a float16/bfloat16 "
                          "graph convert with target='onnxruntime' (the default), which computes such nodes in "
                          "float32 (docs/finetuning.md)") from exc


# bridge's graphs have been through bridge's own common subexpression elimination; onnxruntime's would merge the
# forward values that a backward recomputes (memory="min", the recompute_from_kept form) back into the forward's
# nodes and keep them alive through the backward
_DISABLED_OPTIMIZERS = ["CommonSubexpressionElimination"]


class OrtGraph:
    """One ONNX graph in onnxruntime, run by input name."""

    def __init__(self, model: onnx.ModelProto, providers=None, threads: int | None = None, spinning: bool = True,
                 dropped_outputs: Callable[[str], bool] | None = None, piece: bool = False):
        """``dropped_outputs``: graph outputs (by name) the session does not return; onnxruntime then
        plans their buffers as intermediate values (reused in place once read). ``piece=True``: the graph is
        one of a step's pieces, run in turn (``TrainingSession(in_place=True)``): without the CPU arena, so that
        the memory it frees serves the next piece, and its threads stop spinning when its run ends, leaving
        the cores to the next piece's threads."""
        import onnxruntime as ort

        options = session_options(threads, spinning)
        if PRECISION in props(model.metadata_props):
            # onnxruntime's graph optimizations run some float16 nodes in float32 without rounding back: a
            # gradient that overflows in torch's autocast stays finite, and loss scaling no longer skips its step
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        providers = providers or ["CPUExecutionProvider"]
        if piece or MEMORY in props(model.metadata_props):  # the arena would keep what the step frees reserved
            options.enable_cpu_mem_arena = False
        if piece:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        with outputs_dropped(model, dropped_outputs), _kernels_checked():
            if is_large(model):  # past protobuf's 2 GiB: through a file with external data
                with external_copy(model) as path:
                    self.session = ort.InferenceSession(path, options, providers=providers,
                                                        disabled_optimizers=_DISABLED_OPTIMIZERS)
            else:
                self.session = ort.InferenceSession(model.SerializeToString(), options, providers=providers,
                                                    disabled_optimizers=_DISABLED_OPTIMIZERS)
        self.input_names = [value.name for value in self.session.get_inputs()]
        self.output_names = [value.name for value in self.session.get_outputs()]
        self._run = unchecked_run(self.session)
        self._bindings: dict[tuple[int, ...], _Binding] = {}  # run_into's, by the ids of its output arrays

    def __call__(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {name: feed[name] for name in self.input_names}
        return dict(zip(self.output_names, self._run(self.output_names, feed, None), strict=True))

    def run_into(self, feed: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Like calling the graph, but every output named in ``into`` is written into that (C-contiguous)
        array, of the output's shape and dtype, instead of a buffer allocated by the step; the results hold
        those arrays. The inputs are bound without copies (onnxruntime's IOBinding). The bindings of the
        last two sets of ``into`` arrays are kept, and an input is bound again only when its array changed."""
        import onnxruntime as ort

        key = tuple(id(value) for value in into.values())
        if key not in self._bindings:
            if len(self._bindings) >= 2:
                self._bindings.clear()
            binding = self.session.io_binding()
            for name in self.output_names:  # get_outputs returns them in the order they were first bound
                if name in into:
                    binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(into[name]))
                else:
                    binding.bind_output(name)
            self._bindings[key] = _Binding(binding, dict(into))
        bound = self._bindings[key]
        for name in self.input_names:
            value = feed[name]
            if bound.inputs.get(name) is not value or not value.flags.c_contiguous:
                bound.binding.bind_cpu_input(name, np.ascontiguousarray(value))
                bound.inputs[name] = value
        for name in self.output_names:
            if name not in into:  # allocated by onnxruntime each step: its shape may follow the batch
                bound.binding.bind_output(name)
        self.session.run_with_iobinding(bound.binding)
        return {name: into[name] if name in into else value.numpy()
                for name, value in zip(self.output_names, bound.binding.get_outputs(), strict=True)}


@dataclass
class _Binding:
    """An onnxruntime IOBinding with its output arrays (held, so that their ids stay theirs) and the arrays
    its inputs are bound to (held: onnxruntime reads their memory)."""

    binding: Any
    outputs: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


class SessionGraph:
    """A compiled graph's step session called like ``OrtGraph`` (inputs and outputs by name), its state
    unused: the gradient or update half of a step, for accumulation and data parallelism."""

    def __init__(self, session: StepSession):
        self._session = session
        self.input_names, self.output_names = session.input_names, session.output_names

    def __call__(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._session._run(dict(feed))


class EvalGraph:
    """The eval graph in onnxruntime, fed with a session's weights and buffers and a checked batch."""

    def __init__(self, model: onnx.ModelProto, providers=None):
        self.graph = OrtGraph(model, providers)
        self.checks = StepChecks.from_model(model)

    def __call__(self, state: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray],
                 target: np.ndarray) -> dict[str, np.ndarray]:
        self.checks.check(inputs, target)
        return self.graph({**state, **inputs, "target": target})


class SplitStep:
    """The gradient and update graphs of a step in onnxruntime (see ``StepSession.accumulate``)."""

    def __init__(self, gradient_model: onnx.ModelProto, update_model: onnx.ModelProto, providers=None):
        self.gradient = OrtGraph(gradient_model, providers)
        self.update = OrtGraph(update_model, providers)
        self.checks = StepChecks.from_model(gradient_model)
        self.random_inputs = random_inputs(gradient_model, self.gradient)
        self.gradients = [name for name in self.gradient.output_names if is_gradient(name)]
        loss_type = gradient_model.graph.output[0].type.tensor_type.elem_type  # "loss" is the first output
        self.loss_dtype = onnx.helper.tensor_dtype_to_np_dtype(loss_type)
        self.buffers = [strip_prefix(name, UPDATED_PREFIX) for name in self.gradient.output_names
                        if name.startswith(UPDATED_PREFIX)]
        options = json.loads(props(gradient_model.metadata_props).get(LOSS_OPTIONS, "{}"))
        self.mean_loss = options.get("reduction", "mean") != "sum"


def random_inputs(model: onnx.ModelProto, graph: OrtGraph) -> dict[str, NoiseSpec]:
    """The noise inputs of ``model`` (model metadata): name -> (shape, dtype), a symbolic dim by its dim_param."""
    random = decode_random_inputs(props(model.metadata_props))
    found: dict[str, NoiseSpec] = {}
    for value in graph.session.get_inputs():
        if value.name in random:
            shape = [d if isinstance(d, (int, str)) else None for d in value.shape]
            found[value.name] = (shape, np.dtype(np.float64 if value.type == "tensor(double)" else np.float32))
    return found


def is_gradient(name: str) -> bool:
    """Whether graph output ``name`` is a gradient (``grad_<weight>``)."""
    return name.startswith(GRAD_PREFIX)


class TrainingSession(StepSession):
    """Train with a training ONNX model in onnxruntime: ``session.step(inputs, target)`` -> outputs.

    With ``eval_model`` (``TrainingModel.eval_model``), ``evaluate(inputs, target)`` runs it.
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike, state: Mapping[str, np.ndarray], providers=None,
                 seed: int | None = None, *, eval_model: onnx.ModelProto | None = None, on_nonfinite: str = "raise",
                 threads: int | None = None, spinning: bool = True, gradients: bool = True,
                 swap_buffers: bool = False, in_place: bool = False):
        """``threads``, ``spinning``: onnxruntime's intra-op thread count (default: its own, one per
        physical core) and whether they spin between parallel ops (``session_options``).
        ``gradients=False``: ``step`` does not return the ``grad_*`` outputs, so onnxruntime need not
        keep them past the update (it reuses their buffers in place); the step computes the same.
        ``swap_buffers=True``: the updated state is written into a second set of state buffers, allocated
        once with the session, and the two sets swap roles each step, so a step allocates no state of its
        own (``StateBuffers``). The state arrays and the ``updated_*`` a step returns are then reused two
        steps later: copy what must outlive that.
        ``in_place=True``: the graph runs in pieces, its optimizer phase cut so that no piece replaces more than
        ``STATE_SHARE_PER_PIECE`` of the state, and the session drops each old state array once the last piece
        reading it has run, so each piece's new state takes the old's memory (``PiecewiseStep``); each piece
        runs without onnxruntime's CPU arena, which would keep the memory freed in one piece from the next
        (``OrtGraph(piece=True)``).
        The old state is gone after a step: ``on_nonfinite="skip"`` is refused."""
        for option, value in (("gradients", gradients), ("swap_buffers", swap_buffers), ("in_place", in_place)):
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{option}={value!r} is not valid; give True or False")
        if in_place and swap_buffers:
            raise InvalidOptionError("in_place=True and swap_buffers=True cannot be combined: swap_buffers writes the "
                                     "new state into a second set of state buffers kept between steps, which in_place "
                                     "avoids by releasing the old state as the step goes; give one of them")
        model = read_model(model)
        super().__init__(state, seed, checks=StepChecks.from_model(model), on_nonfinite=on_nonfinite,
                         graph_hash=graph_hash(model), eval_model=eval_model, covered=covered_outputs(model))
        dropped = None if gradients else is_gradient
        self._graph: OrtGraph | None = None
        self._piecewise: PiecewiseStep | None = None
        if in_place:
            pieces, self.output_names = _in_place_pieces(model, providers, threads, spinning, dropped)
            self.input_names = [value.name for value in model.graph.input]
            self._set_in_place([name for name in self.input_names if updated_name(name) in self.output_names])
            self._piecewise = PiecewiseStep(pieces, self.output_names, self.in_place, _run_ort_piece,
                                            "TrainingSession(in_place=True)")
            graphs = [cast(OrtGraph, piece.session) for piece in pieces]
        else:
            self._graph = OrtGraph(model, providers, threads, spinning, dropped)
            self.input_names, self.output_names = self._graph.input_names, self._graph.output_names
            graphs = [self._graph]
        noise = {name: spec for graph in graphs for name, spec in random_inputs(model, graph).items()}
        self.random_inputs.update({name: noise[name] for name in self.input_names if name in noise})  # drawn in this order
        self.dim_bounds = json.loads(props(model.metadata_props).get(DIM_BOUNDS, "{}"))
        updated = [strip_prefix(name, UPDATED_PREFIX) for name in self.output_names if name.startswith(UPDATED_PREFIX)]
        self._buffers = StateBuffers(self.state, updated) if swap_buffers else None

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._piecewise is not None:
            return self._piecewise(feed, self.state)
        assert self._graph is not None
        if self._buffers is None:
            return self._graph(feed)
        return self._graph.run_into(feed, self._buffers.targets(self.state))


def _in_place_pieces(model: onnx.ModelProto, providers, threads: int | None, spinning: bool,
                     dropped: Callable[[str], bool] | None) -> tuple[list[LoadedPiece], list[str]]:
    """``model`` (without the ``dropped`` outputs) cut as ``TrainingSession(in_place=True)`` runs it, and its
    output names: cut only in the optimizer phase (the first piece is the forward, the backward and the first
    updates), so that no piece replaces more than ``STATE_SHARE_PER_PIECE`` of the state (``state_bounded_cuts``);
    one onnxruntime session per piece, with the graph's options (its
    metadata) and ``OrtGraph(piece=True)``'s."""
    from ..tools.pieces import STATE_SHARE_PER_PIECE, split

    with outputs_dropped(model, dropped):
        pieces = split(model, 1, state_share=STATE_SHARE_PER_PIECE)
        output_names = [value.name for value in model.graph.output]
    loaded = []
    for piece in pieces:
        piece.model.metadata_props.extend(model.metadata_props)
        graph = OrtGraph(piece.model, providers, threads, spinning, piece=True)
        loaded.append(LoadedPiece(graph, graph.input_names, graph.output_names))
    return loaded, output_names


def _run_ort_piece(piece: LoadedPiece, values: dict[str, np.ndarray]) -> list[np.ndarray]:
    """One piece of an in_place step, its outputs in ``piece.output_names``' order."""
    return cast(OrtGraph, piece.session)._run(piece.output_names, {name: values[name] for name in piece.input_names}, None)


class StateBuffers:
    """Two sets of buffers for the updated state: a step reads the state from one set and writes
    ``updated_<x>`` into the other, which becomes the state when the step is committed. The buffers are
    allocated once (like the state given) and owned here; a state value replaced from outside (a loaded
    checkpoint, a new lr) is read as it is and written into whichever buffer does not share its memory."""

    def __init__(self, state: dict[str, np.ndarray], names: list[str]):
        """Pairs for the ``names`` in ``state``; ``state`` then holds the second buffer of each (a copy), so
        that the caller's arrays are not held."""
        self._pairs = {name: self._pair(state[name]) for name in names if name in state}
        state.update({name: pair[1] for name, pair in self._pairs.items()})

    @staticmethod
    def _pair(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Two C-contiguous copies of ``value``: written now, so that their pages are resident from the start
        (a fresh ``np.empty`` is mapped lazily, and a step's first write to it would allocate)."""
        return np.array(value, order="C"), np.array(value, order="C")

    def targets(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The buffer each ``updated_<x>`` output is written into this step: the one of ``x``'s pair that
        the current value of ``x`` does not share memory with (pairs reallocated if ``x`` changed shape)."""
        targets = {}
        for name, pair in self._pairs.items():
            value = state[name]
            if pair[0].shape != value.shape or pair[0].dtype != value.dtype:
                pair = self._pairs[name] = self._pair(value)
            targets[updated_name(name)] = pair[1] if np.may_share_memory(value, pair[0]) else pair[0]
        return targets


def _size(dim, sizes: Mapping, noise: str) -> int:
    """A dim of noise input ``noise``: an int, a named dim, or an expression of named dims (``batch*seq``)."""
    if isinstance(dim, int):
        return dim
    if dim in sizes:
        return sizes[dim]
    import sympy  # only for a dim written as an expression: sympy is slow to import

    symbols = {name: sympy.Symbol(name) for name in sizes if isinstance(name, str)}
    value = sympy.parse_expr(dim, local_dict=symbols).subs({symbols[n]: v for n, v in sizes.items() if n in symbols})
    if not value.is_Integer:
        raise BridgeError(f"noise input '{noise}' has dim '{dim}', which the batch's dims {sorted(symbols)} do not give")
    return int(value)


def _batch(target) -> int | None:
    """The batch size a target gives (None for a 0-d target: a graph without a batch dim)."""
    return len(target) if np.ndim(target) else None
