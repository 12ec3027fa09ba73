"""Data-parallel training on ``torch.distributed`` (gloo): ``DataParallelTrainer`` (docs/distributed.md).

Every rank holds the whole training state and runs the step's two halves (``TrainingModel.gradient_model``
and ``update_model``): the gradient graph on its own shard of the batch, then the float64 gradients
and loss are summed over the ranks with ``all_reduce`` on flat buffers (weighted by shard size, so
uneven shards give the gradient of the whole batch), and every rank runs the update graph (clipping
included) on the same reduced gradients, so the weights stay identical without being sent again.
BatchNorm running statistics stay per rank unless ``average_buffers=True``; Dropout noise is drawn
from a rank-dependent seed. A rank that dies or stops makes the others raise ``DistributedError``
within the process group's timeout.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ..errors import BridgeError, InvalidOptionError, positive_int
from .runtime import StepSession, TrainingSession
from .trainer import BACKENDS, Trainer, _Totals
from .training_model import TrainingModel

BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket size
TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(BridgeError):
    """A collective failed (a rank died or did not reach it within the timeout) or the process
    group is missing or unusable."""


class Collectives:
    """The collectives a data-parallel step needs, on flat buffers, failures as ``DistributedError``.

    ``seconds`` accumulates the time spent in collectives (waiting for the slowest rank included).
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.timeout, self.bucket_bytes = group, timeout, int(bucket_bytes)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.seconds = 0.0

    def all_reduce(self, arrays: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
        """The element-wise sums over the ranks of ``arrays`` (float64)."""
        arrays = {name: np.asarray(value, dtype=np.float64) for name, value in arrays.items()}
        return self._flat(arrays, what, lambda flat: dist.all_reduce(flat, group=self.group, async_op=True))

    def broadcast(self, arrays: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
        """Rank 0's ``arrays`` on every rank (same names, shapes and dtypes on every rank)."""
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return self._flat(dict(arrays), what,
                          lambda flat: dist.broadcast(flat, source, group=self.group, async_op=True))

    def broadcast_object(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` (picklable) on every rank."""
        box = [value]
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._run(what, lambda: dist.broadcast_object_list(box, source, group=self.group))
        return box[0]

    def all_gather_object(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        values: list[Any] = [None] * self.world_size
        self._run(what, lambda: dist.all_gather_object(values, value, group=self.group))
        return values

    def barrier(self, what: str) -> None:
        self._run(what, lambda: dist.barrier(group=self.group))

    def _flat(self, arrays: dict[str, np.ndarray], what: str,
              start: Callable[[torch.Tensor], dist.Work]) -> dict[str, np.ndarray]:
        """``start`` one asynchronous collective per flat bucket (arrays of one dtype, at most
        ``bucket_bytes``), all in flight together; the arrays unpacked from the results. One rank
        alone is its own result (gloo's worker threads would only add a hand-off)."""
        if self.world_size == 1:
            return arrays
        buckets = self._buckets(arrays)
        flats = [torch.from_numpy(np.concatenate([np.ravel(arrays[name]) for name in bucket])) for bucket in buckets]

        def run() -> None:
            for work in [start(flat) for flat in flats]:
                work.wait()

        self._run(what, run)
        result = {}
        for bucket, flat in zip(buckets, flats, strict=True):
            values, offset = flat.numpy(), 0
            for name in bucket:
                size = arrays[name].size
                result[name] = values[offset:offset + size].reshape(arrays[name].shape)
                offset += size
        return result

    def _buckets(self, arrays: dict[str, np.ndarray]) -> list[list[str]]:
        """Names grouped by dtype, in order, cut where a bucket would pass ``bucket_bytes``."""
        buckets: list[list[str]] = []
        current: dict[np.dtype, tuple[list[str], int]] = {}
        for name, value in arrays.items():
            names, size = current.get(value.dtype, ([], 0))
            if names and size + value.nbytes > self.bucket_bytes:
                buckets.append(names)
                names, size = [], 0
            current[value.dtype] = (names + [name], size + value.nbytes)
        return buckets + [names for names, _ in current.values()]

    def _run(self, what: str, collective: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            collective()
        except RuntimeError as exc:  # torch's DistBackendError and gloo's timeouts are RuntimeErrors
            limit = f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} failed: another rank exited or did not reach it "
                f"within {limit} (see that rank's own error); {str(exc).splitlines()[0]}") from exc
        finally:
            self.seconds += time.perf_counter() - start


class DataParallelTrainer(Trainer):
    """``bridge.Trainer`` across the ranks of a gloo process group: same interface, each rank passes
    its own shard to ``step`` (``fit`` and ``evaluate`` shard the data themselves).

    Create it on every rank, inside ``torch.distributed.init_process_group("gloo")`` (what torchrun
    and ``run_local`` set up); construction is collective (rank 0's state is broadcast).

    Args:
        model, backend, state, schedule, schedule_options, interval, on_nonfinite, progress,
            accumulation_steps: as ``bridge.Trainer`` (``progress`` is shown on rank 0 only; with
            ``backend="iree"`` rank 0 compiles the gradient and update graphs once, for every rank).
        seed: the shuffling seed (rank 0's, for every rank); the Dropout noise of rank ``r`` is seeded
            with ``(seed, r)``.
        average_buffers: average the BatchNorm running statistics over the ranks after each step
            (default: each rank keeps its own, as torch DDP's batch statistics are per rank).
        timeout: seconds a collective waits for the other ranks before ``DistributedError`` (a
            process group of its own); None: the default group's timeout.
        bucket_bytes: size of the flat all-reduce buffers.
    """

    def __init__(self, model: TrainingModel | str | os.PathLike, backend: str = "onnxruntime", *,
                 seed: int = 0, average_buffers: bool = False, timeout: float | None = None,
                 bucket_bytes: int = BUCKET_BYTES, progress: bool = False, **options):
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError("DataParallelTrainer runs inside a process group: call "
                                   "torch.distributed.init_process_group('gloo') on every rank first (torchrun "
                                   "sets its environment), or launch with bridge.training.distributed.run_local")
        if backend not in BACKENDS:
            raise InvalidOptionError(f"backend={backend!r} is not one of {BACKENDS}")
        group = None if timeout is None else dist.new_group(backend="gloo",
                                                            timeout=datetime.timedelta(seconds=timeout))
        self.collectives = Collectives(group, timeout, bucket_bytes)
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.backend, self.average_buffers = backend, average_buffers
        self._seed = int(self.collectives.broadcast_object(seed, "sharing the seed"))
        super().__init__(model, backend, seed=self._seed, progress=progress and self.rank == 0, **options)
        self._enable_accumulation()
        state = self.collectives.broadcast(self.session.state, "broadcasting rank 0's initial state")
        self.session.state = {name: value.copy() for name, value in state.items()}

    # -- the step ------------------------------------------------------------------------------

    def step(self, inputs: Mapping[str, np.ndarray] | np.ndarray, target: np.ndarray) -> dict[str, Any]:
        """One optimizer step on the batch made of every rank's shard ``(inputs, target)``: ``loss``
        of the whole batch and this shard's ``output_*``."""
        return self.accumulate([(inputs, target)])

    def _make_session(self, backend: str, graph: onnx.ModelProto, evaluation: onnx.ModelProto | None,
                      state: dict[str, np.ndarray], seed: int, on_nonfinite: str, threads: int | None,
                      spinning: bool) -> StepSession:
        """An onnxruntime session holding the state (the gradient and update graphs run the steps,
        on ``backend``), its Dropout noise seeded per rank."""
        return TrainingSession(graph, state, seed=[seed, self.rank], eval_model=evaluation,
                               on_nonfinite=on_nonfinite, threads=threads, spinning=spinning)

    def _compiled(self, graphs: Sequence[onnx.ModelProto]) -> list:
        """The graphs compiled by the backend (IREE, onnx-mlir) on rank 0, the modules sent to every rank."""
        from ..tools.compile import compile as compile_model
        from .trainer import compiled_graph

        modules = [compile_model(graph, backend=self.backend).module for graph in graphs] if self.rank == 0 else None
        modules = self.collectives.broadcast_object(modules, f"sharing the {self.backend} modules compiled on rank 0")
        return [compiled_graph(self.backend, module, graph) for module, graph in zip(modules, graphs, strict=True)]

    def _accumulate(self, batches: list[tuple[dict[str, np.ndarray], np.ndarray]]) -> dict[str, np.ndarray]:
        results = self.session.accumulate(batches, reduce=self._reduce_gradients)
        if self.average_buffers and self.session.split_step.buffers:
            names = self.session.split_step.buffers
            sums = self.collectives.all_reduce({name: self.session.state[name] for name in names},
                                               "averaging the BatchNorm statistics")
            self.session.state.update({name: (sums[name] / self.world_size).astype(self.session.state[name].dtype)
                                       for name in names})
        return results

    def _reduce_gradients(self, sums: dict[str, np.ndarray], samples: int) -> dict[str, np.ndarray]:
        """The loss and gradients of the whole batch from each rank's (means over ``samples``, or
        sums for a sum-reduced loss)."""
        weight = samples if self.session.split_step.mean_loss else 1
        reduced = self.collectives.all_reduce({"samples": np.float64(samples),
                                               **{name: value * weight for name, value in sums.items()}},
                                              "the gradient all-reduce")
        total = reduced.pop("samples") if self.session.split_step.mean_loss else 1.0
        return {name: value / total for name, value in reduced.items()}

    # -- data sets -----------------------------------------------------------------------------

    def _batches(self, order: np.ndarray, size: int) -> tuple[list[np.ndarray], int]:
        """This rank's shard of each global batch of ``size`` samples per rank (the same ``order`` on
        every rank); a last global batch with fewer samples than ranks is dropped (counted)."""
        batches, dropped = super()._batches(order, size * self.world_size)
        if batches and len(batches[-1]) < self.world_size:
            dropped += len(batches.pop())
        return [np.array_split(batch, self.world_size)[self.rank] for batch in batches], dropped

    def _metrics(self, totals: _Totals) -> dict[str, float]:
        """The metrics of every rank's totals together."""
        fields = ("loss", "samples", "correct", "counted")
        sums = self.collectives.all_reduce({name: np.float64(getattr(totals, name)) for name in fields},
                                           "summing the metrics")
        merged = _Totals()
        merged.loss = float(sums["loss"])
        merged.samples, merged.correct, merged.counted = (int(sums[name]) for name in fields[1:])
        return merged.metrics()

    # -- checkpoints and export ----------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Rank 0 writes the checkpoint (atomically) with every rank's noise generator; every rank
        returns once it is written."""
        noise = self.collectives.all_gather_object(self.session._rng.bit_generator.state,
                                                   "gathering the noise generators")
        if self.rank == 0:
            extra = {**self._checkpoint_extra(), "world_size": self.world_size, "noise_rngs": noise}
            self.session.save_checkpoint(path, extra=extra)
        self.collectives.barrier(f"waiting for rank 0 to write {path}")
        return Path(path)

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Every rank reads the checkpoint (a shared file system, or a copy per machine). Written by
        as many ranks as now, each rank continues its own noise; otherwise rank ``r``'s noise is
        re-seeded from ``(seed, r, step)``."""
        extra = super().load_checkpoint(path)
        if extra.get("world_size") == self.world_size:
            self.session._rng.bit_generator.state = extra["noise_rngs"][self.rank]
        else:
            step = int(self.session.state.get("step", 0))
            self.session._rng = np.random.default_rng([self._seed, self.rank, step])
        self.collectives.barrier(f"loading {path}")
        return extra

    def export_inference(self, path: str | os.PathLike) -> Path:
        """Rank 0 writes the inference model with the trained weights (its running statistics)."""
        if self.training_model is None or self.rank == 0:  # without the source model: the error on every rank
            super().export_inference(path)
        self.collectives.barrier(f"waiting for rank 0 to write {path}")
        return Path(path)


# -- launching ---------------------------------------------------------------------------------

def launched_by_torchrun() -> bool:
    """Whether the environment describes a process group (torchrun's variables)."""
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def init_from_environment(timeout: float | None = None) -> bool:
    """Join the gloo process group that the environment describes (torchrun), unless one is already
    initialized; returns whether this process is in a process group."""
    if dist.is_initialized():
        return True
    if not launched_by_torchrun():
        return False
    options = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group("gloo", **options)
    return True


def run_local(function: Callable[..., Any], nproc: int, args: tuple = (), timeout: float | None = None,
              join: bool = True) -> mp.ProcessContext | None:
    """Run ``function(*args)`` in ``nproc`` new local processes, each inside a gloo process group on
    loopback (a free port; ``timeout`` for the group). Raises ``DistributedError`` naming the first
    rank that failed; with ``join=False``, returns the processes (``torch.multiprocessing``) instead."""
    nproc = positive_int(nproc, "nproc")
    port = _free_port()
    context = mp.start_processes(_rank_main, args=(nproc, port, timeout, function, args), nprocs=nproc,
                                 join=False, start_method="spawn")
    if not join:
        return context
    try:
        while not context.join():
            pass
    except ProcessException as exc:
        raise DistributedError(f"rank {exc.error_index} of {nproc} failed: {_last_line(str(exc))}") from exc
    return None


def _rank_main(rank: int, world_size: int, port: int, timeout: float | None, function: Callable[..., Any],
               args: tuple) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    init_from_environment(timeout)
    try:
        function(*args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
