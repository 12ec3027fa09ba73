"""Training-step time: bridge's graph in onnxruntime vs eager PyTorch, measured side by side.

    python benchmarks/bench_step.py [--repeats 30]

For each model: conversion time, then ``repeats`` rounds; each round times one onnxruntime
step and one eager torch step (forward, loss, backward, torch.optim step) back to back, so
both see the same machine load. Reports medians and the median of per-round ratios
(ratio > 1: onnxruntime slower than eager torch).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import bridge


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )


MODELS = {"mlp": (_mlp, (32, 64)), "cnn": (_cnn, (16, 3, 32, 32))}


def bench(name: str, repeats: int, workdir: Path) -> dict:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    module = build()
    path = workdir / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(shape),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    start = time.perf_counter()
    tm = bridge.to_training_onnx(path, loss="ce", optim="adam", optim_options={"lr": 1e-3})
    convert_s = time.perf_counter() - start

    session = tm.session()
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    target = rng.integers(0, 10, shape[0])
    xt, tt = torch.tensor(x), torch.tensor(target)

    def torch_step():
        opt.zero_grad()
        F.cross_entropy(module(xt), tt).backward()
        opt.step()

    def ort_step():
        session.step({"x": x}, target)

    ort_step(), torch_step()  # warm-up
    ort_times, torch_times = [], []
    for _ in range(repeats):
        for fn, times in ((ort_step, ort_times), (torch_step, torch_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    ratios = [o / t for o, t in zip(ort_times, torch_times)]
    return {
        "model": name,
        "nodes": len(tm.model.graph.node),
        "convert_s": convert_s,
        "ort_ms": 1e3 * statistics.median(ort_times),
        "torch_ms": 1e3 * statistics.median(torch_times),
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    print(f"{'model':6} {'nodes':>6} {'convert s':>10} {'ort ms':>8} {'torch ms':>9} {'ort/torch':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            r = bench(name, args.repeats, Path(tmp))
            print(f"{r['model']:6} {r['nodes']:6d} {r['convert_s']:10.2f} {r['ort_ms']:8.2f} {r['torch_ms']:9.2f} {r['ratio']:10.2f}")


if __name__ == "__main__":
    main()
