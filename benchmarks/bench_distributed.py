"""Data-parallel throughput: 1, 2 and 4 ranks (gloo on loopback), and the communication share.

    python benchmarks/bench_distributed.py [--ranks 1 2 4] [--steps 40] [--batch 32]

Weak scaling: every rank steps on its own batch of ``--batch`` samples (the global batch is
ranks x batch) with ``bridge.training.distributed.DataParallelTrainer`` in onnxruntime. After 5 warm-up
steps, ``--steps`` steps are timed on every rank; reported: global samples per second (rank 0's
wall time), the median step time, the share of the step spent in collectives (the gradient
all-reduce, waiting for the slowest rank included), and the transfer share: the median time of the
same all-reduce started right after a barrier (no waiting), over the median step time. More ranks
than cores oversubscribe the CPU
(each onnxruntime session also starts its own threads), so the figures for them measure
contention as much as communication; the machine's core count and load are printed with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import bridge
from bridge.training.distributed import DataParallelTrainer, run_local

WARMUP = 5


def _mlp() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """An MLP: 64 -> 256 -> 256 -> 10 (85k weights)."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return module, (64,)


def _cnn() -> tuple[torch.nn.Module, tuple[int, ...]]:
    """A CNN on 3x32x32 images (25k weights)."""
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10))
    return module, (3, 32, 32)


MODELS = {"mlp": _mlp, "cnn": _cnn}


def convert(name: str, directory: Path) -> tuple[Path, tuple[int, ...], int]:
    """The model converted (Adam) and saved; its sample shape and weight count."""
    torch.manual_seed(0)
    module, shape = MODELS[name]()
    source = directory / f"{name}.source.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, *shape),), str(source), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": 1e-3})
    path = tm.save(directory / f"{name}.onnx")
    tm.save_state(directory / f"{name}.state.npz")
    return path, shape, sum(int(np.prod(tm.initial_state()[w].shape)) for w in tm.weights)


def _rank(path: str, shape: tuple[int, ...], batch: int, steps: int, report: str) -> None:
    """Time ``steps`` steps on this rank; rank 0 writes the figures to ``report`` (JSON)."""
    trainer = DataParallelTrainer(path, timeout=300)
    rng = np.random.default_rng(trainer.rank)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    target = rng.integers(0, 10, batch)
    for _ in range(WARMUP):
        trainer.step(x, target)
    times, shares = [], []
    trainer.collectives.barrier("starting the clock")
    start = time.perf_counter()
    for _ in range(steps):
        communication, begin = trainer.collectives.seconds, time.perf_counter()
        trainer.step(x, target)
        times.append(time.perf_counter() - begin)
        shares.append((trainer.collectives.seconds - communication) / times[-1])
    wall = time.perf_counter() - start
    transfer = _transfer_seconds(trainer)
    figures = trainer.collectives.all_gather_object({"median_share": statistics.median(shares)}, "the figures")
    if trainer.rank == 0:
        Path(report).write_text(json.dumps({
            "ranks": trainer.world_size, "samples_per_s": trainer.world_size * batch * steps / wall,
            "step_ms": 1e3 * statistics.median(times),
            "communication_share": statistics.mean(f["median_share"] for f in figures),
            "transfer_share": transfer / statistics.median(times)}))


def _transfer_seconds(trainer: DataParallelTrainer, repeats: int = 20) -> float:
    """The median time of the step's gradient all-reduce (same sizes) when every rank starts it at once."""
    state = trainer.session.state
    arrays = {"samples": np.float64(0), "loss": np.float64(0),
              **{name: np.zeros(state[name[len("grad_"):]].shape) for name in trainer.session.split_step.gradients}}
    seconds = []
    for _ in range(repeats):
        trainer.collectives.barrier("aligning the ranks")
        start = time.perf_counter()
        trainer.collectives.all_reduce(arrays, "the transfer probe")
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} before the runs; "
          f"batch {args.batch} per rank, {args.steps} timed steps, Adam, onnxruntime")
    print("| model (weights) | ranks | samples/s | speed-up | median step | in collectives | transfer only |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as directory:
        for name in args.models:
            path, shape, weights = convert(name, Path(directory))
            baseline = None
            for ranks in args.ranks:
                report = Path(directory) / f"{name}.{ranks}.json"
                run_local(_rank, ranks, (str(path), shape, args.batch, args.steps, str(report)), timeout=300)
                figures = json.loads(report.read_text())
                baseline = baseline or figures["samples_per_s"]
                print(f"| {name} ({weights // 1000}k) | {ranks} | {figures['samples_per_s']:.0f} | "
                      f"{figures['samples_per_s'] / baseline:.2f} | {figures['step_ms']:.1f} ms | "
                      f"{100 * figures['communication_share']:.0f}% | {100 * figures['transfer_share']:.1f}% |",
                      flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} after the runs")


if __name__ == "__main__":
    main()
