"""The optimizer update alone: bridge's update graph in onnxruntime vs ``torch.optim``'s ``step()``.

    PYTHONPATH=. python benchmarks/optimizer_step.py resnet18 --optim adam sgd --rounds 15

For a benchmark model (benchmarks/models.py) converted with each optimizer (torch's defaults, lr
1e-3; ``sgd`` with momentum 0.9), the update graph (``TrainingModel.update_model``: the optimizer
phase of the step, fed the weights, the optimizer state and one step's gradients) and eager
torch's ``optimizer.step()`` on the same tensors run alternating in one process, both on one
thread, timed as CPU time of the calling thread (``time.thread_time``: robust to a shared
machine's load). Printed per optimizer: the update graph's nodes (and how many of them are per
weight, i.e. passes over a weight's memory), the medians and the median per-round ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import MODELS, torch_loss  # noqa: E402

OPTIONS = {"adam": {"lr": 1e-3}, "adamw": {"lr": 1e-3}, "sgd": {"lr": 1e-3, "momentum": 0.9},
           "rmsprop": {"lr": 1e-3}}
CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}


def update_runner(source: Path, optim: str, bench) -> tuple:
    """The update graph of ``source`` converted with ``optim`` in a one-thread session, fed the
    initial state and the gradients of one step; returns (run, nodes, per-weight nodes)."""
    import bridge
    from bridge.contract import props

    tm = bridge.to_training_onnx(str(source), loss="ce", optim=optim, optim_options=OPTIONS[optim])
    results = tm.session().step(bench.inputs, bench.target)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # as bridge.training.runtime
    session = ort.InferenceSession(tm.update_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = {**tm.initial_state(), **results}
    feed = {value.name: values[value.name] for value in session.get_inputs()}
    per_weight = sum(props(node.metadata_props).get("bridge.layer") != "step" for node in tm.update_model.graph.node)
    return (lambda: session.run(None, feed)), len(tm.update_model.graph.node), per_weight


def torch_runner(bench, optim: str):
    """``optimizer.step()`` of eager torch after one backward (the gradients stay)."""
    optimizer = CLASSES[optim](bench.module.parameters(), foreach=False, **OPTIONS[optim])
    optimizer.zero_grad()
    torch_loss(bench.module(*(torch.from_numpy(v) for v in bench.inputs.values())), torch.from_numpy(bench.target)).backward()
    return optimizer.step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--optim", nargs="*", default=["adam", "sgd"], choices=sorted(OPTIONS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bench = MODELS[args.model]()
    with tempfile.TemporaryDirectory() as tmp:
        source = bench.export(Path(tmp) / f"{args.model}.onnx")
        for optim in args.optim:
            run_graph, nodes, per_weight = update_runner(source, optim, bench)
            steps = {"update graph": run_graph, "torch step()": torch_runner(bench, optim)}
            times: dict[str, list[float]] = {name: [] for name in steps}
            for round_index in range(args.rounds + 2):
                for name in (list(steps) if round_index % 2 else list(steps)[::-1]):
                    start = time.thread_time()
                    steps[name]()
                    if round_index >= 2:  # two warm-up rounds
                        times[name].append(time.thread_time() - start)
            ratio = statistics.median(a / b for a, b in zip(times["update graph"], times["torch step()"], strict=True))
            print(f"{args.model} {optim}: update graph {nodes} nodes ({per_weight} per weight), "
                  + ", ".join(f"{name} {1e3 * statistics.median(t):.2f} ms" for name, t in times.items())
                  + f", ratio {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
