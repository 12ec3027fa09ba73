"""``bridge.Trainer``: a training loop on a training graph (onnxruntime, IREE or onnx-mlir session).

The Trainer owns a ``StepSession`` (the state lives there), an lr schedule fed through the
graph's live ``lr`` input, the shuffling generator, and the history of losses and metrics.
Schedules are torch's own ``torch.optim.lr_scheduler`` classes, stepped on a stand-in
optimizer, so each lr sequence is torch's by construction; ``interval`` says whether one
scheduler step is one epoch (torch's usual loop for step/multistep/cosine) or one batch
(warm-up, one-cycle).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ..contract import LOSS_OUTPUT, OPTIMIZER_OPTIONS, OUTPUT_PREFIX, output_name
from ..contract import TARGET_CLASSES as CLASSES
from ..errors import InvalidOptionError, ModelLoadError, positive_int
from ..onnx_file import read_model
from .delta import read_delta, trained_weights, write_delta
from .runtime import StepSession, TrainingSession
from .training_model import TrainingModel, eval_path, part_path, state_file

BACKENDS = ("onnxruntime", "iree", "onnx-mlir")
# name -> (torch.optim.lr_scheduler class, default interval)
SCHEDULES: dict[str, tuple[str, str]] = {
    "step": ("StepLR", "epoch"),
    "multistep": ("MultiStepLR", "epoch"),
    "exponential": ("ExponentialLR", "epoch"),
    "cosine": ("CosineAnnealingLR", "epoch"),
    "linear_warmup": ("LinearLR", "step"),
    "onecycle": ("OneCycleLR", "step"),
}
INTERVALS = ("epoch", "step")
Data = tuple[Mapping[str, np.ndarray] | np.ndarray, np.ndarray]


class LRSchedule:
    """The lr at each scheduler position: a torch scheduler by name (``SCHEDULES``, with its
    keyword arguments) or a callable ``position -> lr``."""

    def __init__(self, schedule: str | Callable[[int], float], base_lr: float, interval: str | None = None,
                 **options):
        if callable(schedule):
            self.name, self.interval = getattr(schedule, "__name__", "callable"), interval or "epoch"
        elif schedule in SCHEDULES:
            self.name, self.interval = schedule, interval or SCHEDULES[schedule][1]
        else:
            raise InvalidOptionError(f"schedule={schedule!r} is not one of {sorted(SCHEDULES)} or a callable")
        if self.interval not in INTERVALS:
            raise InvalidOptionError(f"interval={self.interval!r} is not one of {INTERVALS}")
        if options.get("cycle_momentum"):
            raise InvalidOptionError("schedule 'onecycle': cycle_momentum=True needs a live momentum input, which "
                                     "the training graph does not have; use cycle_momentum=False")
        self._fn = schedule if callable(schedule) else None
        self._base_lr, self._options = base_lr, options
        self.position = 0
        self._build()

    def _build(self) -> None:
        if self._fn is not None:
            return
        options = dict(self._options)
        if self.name == "onecycle":
            options.setdefault("cycle_momentum", False)
        self._optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self._base_lr)
        scheduler_class = getattr(torch.optim.lr_scheduler, SCHEDULES[self.name][0])
        try:
            self._scheduler = scheduler_class(self._optimizer, **options)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"schedule '{self.name}' ({scheduler_class.__name__}) rejects {options}: {exc}") from exc

    @property
    def lr(self) -> float:
        if self._fn is not None:
            return float(self._fn(self.position))
        return float(self._optimizer.param_groups[0]["lr"])

    def advance(self) -> None:
        """One scheduler step (torch's ``scheduler.step()``)."""
        self.position += 1
        if self._fn is None:
            self._optimizer.step()  # no gradient: changes nothing, keeps torch's call-order check quiet
            self._scheduler.step()

    def restore(self, position: int) -> None:
        """Back to ``position`` (replayed from the start, as the scheduler's own state)."""
        self.position = 0
        self._build()
        for _ in range(position):
            self.advance()


@dataclass
class History:
    """Per-epoch records (``epoch``, ``loss``, ``accuracy``, ``val_*``, ``lr``, ``samples``,
    ``dropped``, ``skipped``, ``seconds``) and per-step records (``loss``, ``lr``)."""

    epochs: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)

    def __getitem__(self, key: str) -> list:
        """One metric over the epochs, e.g. ``history["val_accuracy"]``."""
        return [record.get(key) for record in self.epochs]


class Trainer:
    """Train, evaluate, checkpoint and export a converted model.

    Args:
        model: a ``TrainingModel``, or the path of a saved training graph (its state is read from
            ``state=`` or the ``<name>.state.npz`` that ``tm.save`` and ``bridge convert`` write beside it; its eval
            graph from ``<name>.eval.onnx``).
        backend: ``"onnxruntime"``, ``"iree"`` or ``"onnx-mlir"`` (compiled here with ``bridge.compile``;
            evaluation runs the eval graph on the compiled session's state: compiled too on onnx-mlir,
            in onnxruntime on IREE).
        schedule: an lr schedule name (``SCHEDULES``) or a callable ``position -> lr``; its keyword
            arguments in ``schedule_options``; ``interval`` ``"epoch"`` or ``"step"`` (default per name).
        seed: seeds the Dropout noise and the shuffling.
        on_nonfinite: ``"raise"``, ``"skip"`` or ``"ignore"`` (see ``bridge.training.runtime``).
        progress: show a progress bar (tqdm, if installed; otherwise one line per epoch).
        accumulation_steps: ``fit`` makes one optimizer step per this many batches (gradient
            accumulation: the gradient graph on each micro-batch, the update graph once; see
            ``StepSession.accumulate``). Needs the gradient and update graphs (``TrainingModel``
            or the ``<name>.gradient.onnx`` / ``<name>.update.onnx`` files beside a saved graph).
        threads, spinning: onnxruntime's intra-op threads (default: one per physical core) and whether
            they spin between parallel ops (default) or block (``spinning=False``: for cores shared with
            other busy processes); see ``bridge.training.runtime.session_options``. IREE's come from
            ``iree.runtime.flags``; onnx-mlir's runtime runs on one thread.
    """

    def __init__(self, model: TrainingModel | str | os.PathLike, backend: str = "onnxruntime", *,
                 state: Mapping[str, np.ndarray] | None = None, schedule: str | Callable[[int], float] | None = None,
                 schedule_options: Mapping[str, Any] | None = None, interval: str | None = None, seed: int = 0,
                 on_nonfinite: str = "raise", progress: bool = False, accumulation_steps: int = 1,
                 threads: int | None = None, spinning: bool = True):
        if backend not in BACKENDS:
            raise InvalidOptionError(f"backend={backend!r} is not one of {BACKENDS}")
        if backend != "onnxruntime" and (threads is not None or not spinning):
            raise InvalidOptionError(f"threads= and spinning= are onnxruntime's (bridge.training.runtime.session_options); "
                                     f"backend={backend!r} takes none (IREE's come from iree.runtime.flags, "
                                     "--task_topology_max_group_count=N; onnx-mlir runs on one thread)")
        self.accumulation_steps = positive_int(accumulation_steps, "accumulation_steps")
        self.backend = backend
        self.training_model = model if isinstance(model, TrainingModel) else None
        graph, eval_graph, initial = _load(model, state)
        self.session = self._make_session(backend, graph, eval_graph, initial, seed, on_nonfinite, threads, spinning)
        # the trained weights where this federated round started (export_delta / load_delta), taken when needed
        self._trained = trained_weights(graph)
        self._round_start: dict[str, np.ndarray] | None = None
        self._model = model  # where enable_accumulation finds the gradient and update graphs
        if self.accumulation_steps > 1:
            self._enable_accumulation()
        meta = {p.key: p.value for p in graph.metadata_props}
        self._classes = json.loads(meta.get(CLASSES, "null"))
        self._loss_output = output_name(meta[LOSS_OUTPUT]) if LOSS_OUTPUT in meta else None
        self._batch = _static_batch(self.session)
        # the base lr in float64 as given (the state's lr is float32), so the schedule is torch's to the bit
        base_lr = json.loads(meta.get(OPTIMIZER_OPTIONS, "{}")).get("lr", self.session.lr)
        self.schedule = None if schedule is None else LRSchedule(schedule, float(base_lr), interval,
                                                                 **dict(schedule_options or {}))
        self._rng = np.random.default_rng(seed)
        self.progress = progress
        self.epoch = 0
        self.history = History()

    # -- one batch ------------------------------------------------------------------------------

    def step(self, inputs: Mapping[str, np.ndarray] | np.ndarray, target: np.ndarray) -> dict[str, Any]:
        """One training step at the schedule's lr: ``loss`` (float) and the step's ``output_*``."""
        return self._optimizer_step(lambda: self.session.step(self._named(inputs), target))

    def accumulate(self, micro_batches: list[Data]) -> dict[str, Any]:
        """One optimizer step on the effective batch made of ``micro_batches`` (``(inputs, target)``
        pairs), by gradient accumulation (``StepSession.accumulate``): ``loss`` (the
        sample-weighted mean) and ``output_*`` (micro-batches concatenated)."""
        self._enable_accumulation()
        batches = [(self._named(inputs), np.asarray(target)) for inputs, target in micro_batches]
        return self._optimizer_step(lambda: self._accumulate(batches))

    def _make_session(self, backend: str, graph: onnx.ModelProto, evaluation: onnx.ModelProto | None,
                      state: dict[str, np.ndarray], seed: int, on_nonfinite: str, threads: int | None,
                      spinning: bool) -> StepSession:
        """The step session on ``backend`` (a hook: ``bridge.training.distributed`` builds its own)."""
        return _session(backend, graph, evaluation, state, seed, on_nonfinite, threads, spinning)

    def _accumulate(self, batches: list[tuple[dict[str, np.ndarray], np.ndarray]]) -> dict[str, np.ndarray]:
        """One optimizer step of the session's gradient and update graphs over ``batches`` (a hook:
        ``bridge.training.distributed`` reduces the gradients across ranks here)."""
        return self.session.accumulate(batches)

    def _enable_accumulation(self) -> None:
        if self.session.split_step is not None:
            return
        graphs = _split_graphs(self._model)
        if graphs is None:
            raise InvalidOptionError("gradient accumulation needs the gradient and update graphs: create the "
                                     "Trainer from a TrainingModel, or save it with TrainingModel.save")
        self.session.enable_accumulation(*graphs)
        if self.backend != "onnxruntime":  # the two halves compiled too, not run in onnxruntime
            split = self.session.split_step
            split.gradient, split.update = self._compiled(graphs)

    def _compiled(self, graphs: Sequence[onnx.ModelProto]) -> list:
        """The gradient and update graphs compiled by the backend, called by input name like ``OrtGraph``
        (a hook: ``bridge.training.distributed`` compiles once and shares the modules)."""
        from ..tools.compile import compile as compile_model

        return [compiled_graph(self.backend, compile_model(graph, backend=self.backend).module, graph)
                for graph in graphs]

    def _optimizer_step(self, run: Callable[[], dict[str, np.ndarray]]) -> dict[str, Any]:
        """``run`` one optimizer step at the schedule's lr; record it and advance a per-step schedule."""
        if self.schedule is not None:
            self.session.lr = self.schedule.lr
        lr = self.session.lr
        self._round()
        results = run()
        self.history.steps.append({"loss": float(results["loss"]), "lr": lr})
        if self.schedule is not None and self.schedule.interval == "step":
            self.schedule.advance()
        return {"loss": float(results["loss"]), **{k: v for k, v in results.items() if k.startswith(OUTPUT_PREFIX)}}

    def state(self) -> dict[str, np.ndarray]:
        """A copy of the training state (weights, buffers, optimizer state, step, lr)."""
        return {name: value.copy() for name, value in self.session.state.items()}

    # -- whole data sets ------------------------------------------------------------------------

    def fit(self, data: Data, epochs: int = 1, batch_size: int | None = None, shuffle: bool = True,
            validation: Data | None = None) -> History:
        """Train ``epochs`` epochs over ``data`` = ``(inputs, target)`` (arrays with the samples first).

        With a dynamic batch the last partial batch is trained as it is; with a static batch
        (``batch_size`` must then be the graph's) it is dropped and counted in ``dropped``.
        With ``accumulation_steps`` k > 1, ``batch_size`` is the micro-batch: each optimizer step
        accumulates k consecutive batches (the last step of an epoch may have fewer).
        """
        inputs, target = self._named(data[0]), np.asarray(data[1])
        size = self._batch_size(batch_size)
        for _ in range(epochs):
            start, totals = time.perf_counter(), _Totals()
            order = self._rng.permutation(len(target)) if shuffle else np.arange(len(target))
            batches, dropped = self._batches(order, size)
            skipped = self.session.skipped_steps
            record = {"epoch": self.epoch + 1, "lr": self.schedule.lr if self.schedule else self.session.lr}
            for group in self._progress(self._groups(batches), f"epoch {self.epoch + 1}"):
                micro = [({k: v[index] for k, v in inputs.items()}, target[index]) for index in group]
                results = self.step(*micro[0]) if self.accumulation_steps == 1 else self.accumulate(micro)
                totals.add(results["loss"], results.get(self._loss_output), target[np.concatenate(group)],
                           self._classes)
            record.update(self._metrics(totals), dropped=dropped, skipped=self.session.skipped_steps - skipped)
            if validation is not None:
                record.update({f"val_{k}": v for k, v in self.evaluate(validation, batch_size).items()})
            record["seconds"] = time.perf_counter() - start
            self.history.epochs.append(record)
            self.epoch += 1
            if self.schedule is not None and self.schedule.interval == "epoch":
                self.schedule.advance()
            if self.progress:
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()),
                      file=sys.stderr)
        return self.history

    def evaluate(self, data: Data, batch_size: int | None = None) -> dict[str, float]:
        """The eval graph over ``data``: sample-weighted mean ``loss``, ``accuracy`` for class-index
        targets, and ``samples`` (a static graph drops the last partial batch)."""
        inputs, target = self._named(data[0]), np.asarray(data[1])
        batches, _ = self._batches(np.arange(len(target)), self._batch_size(batch_size))
        totals = _Totals()
        for index in batches:
            results = self.session.evaluate({k: v[index] for k, v in inputs.items()}, target[index])
            totals.add(float(results["loss"]), results.get(self._loss_output), target[index], self._classes)
        return self._metrics(totals)

    # -- checkpoints and export ----------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """The session's state and this loop's position (epoch, schedule, shuffling, history)."""
        return self.session.save_checkpoint(path, extra=self._checkpoint_extra())

    def _checkpoint_extra(self) -> dict[str, Any]:
        """This loop's position, as a checkpoint holds it."""
        return {"epoch": self.epoch, "schedule_position": self.schedule.position if self.schedule else 0,
                "shuffle_rng": self._rng.bit_generator.state,
                "history": {"epochs": self.history.epochs, "steps": self.history.steps}}

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Resume from ``save_checkpoint``: the continuation is bit-identical. Returns the
        checkpoint's ``extra`` (this loop's position)."""
        extra = self.session.load_checkpoint(path)
        self._round_start = None
        self.epoch = extra["epoch"]
        if self.schedule is not None:
            self.schedule.restore(extra["schedule_position"])
        self._rng.bit_generator.state = extra["shuffle_rng"]
        self.history = History(**extra["history"])
        return extra

    def export_inference(self, path: str | os.PathLike, merge: bool = True) -> Path:
        """The source inference model with the trained weights and running statistics (LoRA adapters merged
        in, or with ``merge=False`` kept beside the base weights)."""
        if self.training_model is None:
            raise InvalidOptionError("export_inference needs the source model: create the Trainer from the "
                                     "TrainingModel that to_training_onnx returned")
        return self.training_model.export_inference(path, self.session.state, merge)

    def _round(self) -> dict[str, np.ndarray]:
        """The trained weights where this round started: as they were at the first step after the Trainer's
        creation, ``load_checkpoint`` or ``load_delta``."""
        if self._round_start is None:
            self._round_start = {name: self.session.state[name].copy() for name in self._trained}
        return self._round_start

    def export_delta(self, path: str | os.PathLike, samples: int = 1) -> Path:
        """Write the trained weights' change since this round started (``_round``) and the ``samples`` it
        was trained on: a federated client's update (bridge.training.delta; only the trained weights, e.g. a
        LoRA conversion's adapters)."""
        return write_delta(path, {name: self.session.state[name].astype(np.float64) - start
                                  for name, start in self._round().items()}, samples)

    def load_delta(self, path: str | os.PathLike) -> None:
        """Start the next round from this round's start plus the delta at ``path`` (e.g. the clients' average,
        ``bridge.training.delta.average_deltas``): clients that load the same delta hold the same weights.
        Optimizer state and buffers are kept."""
        start = self._round()
        delta, _ = read_delta(path, {name: value.shape for name, value in start.items()})
        for name, value in start.items():
            start[name] = (value + delta[name]).astype(value.dtype)
            self.session.state[name] = start[name].copy()

    # -- helpers -------------------------------------------------------------------------------

    def _named(self, inputs: Mapping[str, np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
        """``inputs`` by name (a bare array when the graph has one data input)."""
        if isinstance(inputs, Mapping):
            return dict(inputs)
        names = [n for n in self.session.checks.required if n != "target"] if self.session.checks else []
        if len(names) != 1:
            raise InvalidOptionError(f"the graph takes inputs {names}: pass a dict of arrays by name")
        return {names[0]: np.asarray(inputs)}

    def _metrics(self, totals: _Totals) -> dict[str, float]:
        """The metrics of ``totals`` (a hook: ``bridge.training.distributed`` sums them over the ranks first)."""
        return totals.metrics()

    def _batch_size(self, batch_size: int | None) -> int:
        if self._batch is not None:
            if batch_size not in (None, self._batch):
                raise InvalidOptionError(f"the training graph has the static batch size {self._batch}, not "
                                         f"{batch_size}: convert with dynamic_batch=True to train at other sizes")
            return self._batch
        return 32 if batch_size is None else positive_int(batch_size, "batch_size")

    def _batches(self, order: np.ndarray, size: int) -> tuple[list[np.ndarray], int]:
        """Index batches of ``order``; a static graph drops the last partial one (its count returned)."""
        batches = [order[i:i + size] for i in range(0, len(order), size)]
        if self._batch is not None and batches and len(batches[-1]) < size:
            return batches[:-1], len(batches[-1])
        return batches, 0

    def _groups(self, batches: list[np.ndarray]) -> list[list[np.ndarray]]:
        """The batches of one optimizer step each: ``accumulation_steps`` consecutive batches."""
        k = self.accumulation_steps
        return [batches[i:i + k] for i in range(0, len(batches), k)]

    def _progress(self, batches: list, description: str) -> Iterator:
        if not self.progress:
            return iter(batches)
        try:
            from tqdm import tqdm
        except ImportError:
            return iter(batches)
        return iter(tqdm(batches, desc=description, leave=False))


class _Totals:
    """Sample-weighted loss and accuracy over batches."""

    def __init__(self):
        self.loss, self.samples, self.correct, self.counted = 0.0, 0, 0, 0

    def add(self, loss: float, logits: np.ndarray | None, target: np.ndarray, classes: dict | None) -> None:
        if not np.isfinite(loss):  # a skipped step (on_nonfinite="skip") or an all-ignored batch
            return
        self.loss += loss * len(target)
        self.samples += len(target)
        if logits is not None and classes is not None:
            keep = target != classes["ignore_index"]
            predicted = np.argmax(logits, axis=classes["axis"])
            self.correct += int(((predicted == target) & keep).sum())
            self.counted += int(keep.sum())

    def metrics(self) -> dict[str, float]:
        metrics = {"loss": self.loss / self.samples if self.samples else float("nan"), "samples": self.samples}
        if self.counted:
            metrics["accuracy"] = self.correct / self.counted
        return metrics


def _load(model: TrainingModel | str | os.PathLike, state: Mapping[str, np.ndarray] | None):
    """The training graph, its eval graph (or None) and the initial state."""
    if isinstance(model, TrainingModel):
        return model.model, model.eval_model, dict(state) if state is not None else model.initial_state()
    path = Path(model)
    if not path.is_file():
        raise ModelLoadError(f"no training model at {path}")
    graph = read_model(path)
    evaluation = read_model(eval_path(path)) if eval_path(path).is_file() else None
    if state is None:
        state_path = state_file(path)
        if not state_path.is_file():
            raise ModelLoadError(f"no state for {path}: pass state= or write {state_path} (tm.save and bridge convert do)")
        with np.load(state_path) as saved:
            state = {name: saved[name] for name in saved.files}
    return graph, evaluation, dict(state)


def _split_graphs(model: TrainingModel | str | os.PathLike) -> tuple[onnx.ModelProto, onnx.ModelProto] | None:
    """The gradient and update graphs of ``model`` (from the TrainingModel, or the files beside
    a saved training graph), or None when there are none."""
    if isinstance(model, TrainingModel):
        if model.gradient_model is None or model.update_model is None:
            return None
        return model.gradient_model, model.update_model
    paths = [part_path(model, part) for part in ("gradient", "update")]
    if not all(path.is_file() for path in paths):
        return None
    return read_model(paths[0]), read_model(paths[1])


def _session(backend: str, graph: onnx.ModelProto, evaluation: onnx.ModelProto | None,
             state: dict[str, np.ndarray], seed: int, on_nonfinite: str, threads: int | None,
             spinning: bool) -> StepSession:
    if backend == "onnxruntime":
        return TrainingSession(graph, state, seed=seed, eval_model=evaluation, on_nonfinite=on_nonfinite,
                               threads=threads, spinning=spinning, gradients=False, swap_buffers=True)
    from ..tools.compile import compile as compile_model

    compiled = compile_model(graph, backend=backend, gradients=False)
    return compiled.session(state, seed=seed, eval_model=evaluation, on_nonfinite=on_nonfinite)


def compiled_graph(backend: str, module: bytes, graph: onnx.ModelProto):
    """``module``, ``graph`` compiled by ``backend`` (``bridge.compile``), called by input name like ``OrtGraph``."""
    if backend == "onnx-mlir":
        from .runtime_onnx_mlir import OnnxMlirGraph

        return OnnxMlirGraph(module, graph)
    from .runtime_iree import IreeGraph

    return IreeGraph(module, graph)


def _static_batch(session: StepSession) -> int | None:
    """The batch size of a static graph (dim 0 of its target), None for a symbolic batch."""
    if session.checks is None or not session.checks.specs["target"][0]:
        return None
    first = session.checks.specs["target"][0][0]
    return first if isinstance(first, int) else None
