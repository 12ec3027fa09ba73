"""Where a training step's time goes: onnxruntime's profiler, by op type and by phase.

    python benchmarks/profile_step.py resnet18                 # export + convert, then profile
    python benchmarks/profile_step.py resnet18 --graph g.onnx  # reuse a saved training graph
    python benchmarks/profile_step.py small_cnn --save g.onnx  # keep the converted graph
    python benchmarks/profile_step.py resnet18 --torch         # and eager torch's step beside it, by op family

The model is one of benchmarks/models.py (same batch, loss ``ce``, Adam). The graph runs in
onnxruntime as ``bridge.Trainer`` and benchmarks/run.py run it (``TrainingSession``'s session
options, ``--threads`` intra-op threads, no ``grad_*`` outputs) with ``enable_profiling``; after
``--warmup`` steps, ``--steps`` steps are profiled. Each node's kernel time is summed over those
steps and grouped by op type, by the node's ``bridge.phase`` (forward, loss, backward, optimizer)
and by both; the tables print the milliseconds per step and the share of all kernel time.

``--torch`` also profiles eager torch's step of the same model (forward, loss, backward,
``torch.optim.Adam``; ``torch.profiler`` self times, same threads), the two alternating in bursts
of ``BURST`` steps so that both see the same phases of a shared machine, and prints both by op
family (``family``: convolution, batch norm, pooling, ...; the loss and the optimizer apart) and
by forward / backward: where bridge's step loses to torch's. Both profilers inflate small ops
(a few us each: bridge's step has more of them).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this checkout's bridge, not an installed one
from models import MODELS  # noqa: E402
from run import LR, settle_with, torch_stepper  # noqa: E402

from bridge.contract import KIND, LAYER, LOSS_LAYER, PHASE, Phase  # noqa: E402

# Op families, first match wins: substrings of a bridge.kind (the source ONNX op, snake case) or of a torch
# profiler op name. The loss and the optimizer are told apart by tags and callers, not by name.
FAMILIES = (
    ("batch norm", ("batch_norm",)),
    ("layer norm", ("layer_norm",)),
    ("convolution", ("conv",)),
    ("pooling", ("pool",)),
    ("matmul", ("gemm", "mat_mul", "matmul", "addmm", "aten::mm", "bmm", "linear")),
    ("activation", ("relu", "threshold", "gelu", "sigmoid", "tanh", "softmax", "clamp", "hardswish", "silu")),
)
LOSS, OPTIMIZER, OTHER = "loss", "optimizer", "other"
BURST = 3  # steps per profiled burst when bridge and torch alternate (--torch), each burst after
SETTLE_S = 0.2  # seconds of untimed steps (settle_with): the other's threads still spin right after its burst
_TORCH_LOSS = ("loss", "log_softmax", "nll", "cross_entropy")


def training_graph(name: str, workdir: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Export and convert benchmark model ``name``; the graph and its initial state."""
    import bridge

    bench = MODELS[name]()
    tm = bridge.to_training_onnx(str(bench.export(workdir / f"{name}.onnx")), loss="ce", optim="adam",
                                 optim_options={"lr": LR})
    return tm.model, tm.initial_state()


def kernel_times(model: onnx.ModelProto, state: dict[str, np.ndarray], feed: dict[str, np.ndarray],
                 target: np.ndarray, threads: int, warmup: int, steps: int,
                 between: Callable[[], None] | None = None) -> dict[str, float]:
    """Microseconds of kernel time per node name, summed over ``steps`` steps after ``warmup``.

    With ``between``, the steps run in bursts of ``BURST``, each after ``SETTLE_S`` of untimed steps, and
    ``between()`` runs after each burst (eager torch's profiled burst: both then see the same machine phases)."""
    import bisect

    import onnxruntime as ort

    from bridge.training.runtime import is_gradient, outputs_dropped, session_options

    options = session_options(threads)  # as bridge.training.runtime runs a step
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "profile")
        with outputs_dropped(model, is_gradient):  # as TrainingSession(gradients=False) and bridge.Trainer run it
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        values = {**state, **feed, "target": target}
        inputs = {value.name: values[value.name] for value in session.get_inputs()}
        runs: list[int] = []  # one entry per session run: whether it is timed

        def run(timed: bool = False) -> None:
            session.run(None, inputs)
            runs.append(timed)

        for _ in range(warmup):
            run()
        while sum(runs) < steps:
            if between is not None and any(runs):  # untimed steps first: torch's threads have just stopped
                settle_with(run, SETTLE_S)
            for _ in range(min(BURST, steps - sum(runs)) if between else steps):
                run(timed=True)
            if between is not None:
                between()
        events = json.loads(Path(session.end_profiling()).read_text())
    model_runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    windows = [window for window, timed in zip(model_runs, runs, strict=True) if timed]
    starts = [begin for begin, _ in windows]
    times: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            at = bisect.bisect_right(starts, event["ts"]) - 1
            if at >= 0 and event["ts"] <= windows[at][1]:
                times[event["name"][: -len("_kernel_time")]] += event["dur"]
    return times


def node_tags(model: onnx.ModelProto) -> dict[str, tuple[str, str, str]]:
    """Node name -> (op type, bridge.phase, bridge.kind: the ATen op family the node comes from)."""
    tags = {}
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        tags[node.name] = (node.op_type, meta.get("bridge.phase", "?"), meta.get("bridge.kind", "?"))
    return tags


def table(title: str, totals: dict, steps: int, top: int) -> str:
    """Rows ``key | ms per step | share``, largest first."""
    whole = sum(totals.values()) or 1.0
    lines = [f"\n{title}", f"{'':60} {'ms/step':>9} {'share':>7}"]
    for key, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        label = key if isinstance(key, str) else " / ".join(key)
        lines.append(f"{label:60} {us / steps / 1e3:9.2f} {100 * us / whole:6.1f}%")
    return "\n".join(lines)


def report(model: onnx.ModelProto, times: dict[str, float], steps: int, top: int) -> str:
    """Kernel time by op type, by phase, by (phase, op type), by (phase, kind, op type) and the top nodes."""
    tags = node_tags(model)
    by_op, by_phase, by_both, by_kind = defaultdict(float), defaultdict(float), defaultdict(float), defaultdict(float)
    for name, us in times.items():
        op, phase, kind = tags.get(name, ("?", "?", "?"))  # a node onnxruntime made (fusions) has no bridge name
        by_op[op] += us
        by_phase[phase] += us
        by_both[(phase, op)] += us
        by_kind[(phase, kind, op)] += us
    total = sum(times.values()) / steps / 1e3
    return "\n".join([
        f"kernel time {total:.1f} ms per step ({len(model.graph.node)} nodes)",
        table("by op type", by_op, steps, top),
        table("by phase", by_phase, steps, top),
        table("by phase / op type", by_both, steps, top),
        table("by phase / kind / op type", by_kind, steps, top),
        table("nodes", times, steps, top),
    ])


def family(name: str) -> str:
    """The op family (``FAMILIES``) of a bridge.kind or a torch op name; ``other`` for none."""
    name = name.lower()
    return next((label for label, marks in FAMILIES if any(mark in name for mark in marks)), OTHER)


def bridge_families(model: onnx.ModelProto, times: dict[str, float]) -> dict[tuple[str, str], float]:
    """Kernel time per (family, forward|backward) of the bridge step; the loss (its own backward included)
    and the optimizer as families of their own."""
    tags = {node.name: {p.key: p.value for p in node.metadata_props} for node in model.graph.node}
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for name, us in times.items():
        tag = tags.get(name, {})
        phase = tag.get(PHASE, "")
        if phase == Phase.OPTIMIZER:
            key = (OPTIMIZER, "")
        elif phase == Phase.LOSS or tag.get(LAYER) == LOSS_LAYER:
            key = (LOSS, "")
        else:
            key = (family(tag.get(KIND, "")), "backward" if phase == Phase.BACKWARD else "forward")
        totals[key] += us
    return totals


class TorchProfile:
    """Eager torch's step of a benchmark model (forward, loss, backward, ``torch.optim.Adam``) profiled
    burst by burst (``burst()``: ``SETTLE_S`` of untimed steps, then ``BURST`` under ``torch.profiler``): self time
    (us) per (family, forward|backward) in ``totals``, over ``steps`` steps taking ``wall`` seconds."""

    def __init__(self, name: str, threads: int, warmup: int):
        import torch

        torch.set_num_threads(threads)
        bench = MODELS[name]()
        self._step = torch_stepper(bench.module.train(), bench)  # run.py's eager step: the same loss, Adam and lr
        self.totals: dict[tuple[str, str], float] = defaultdict(float)
        self.steps, self.wall = 0, 0.0
        for _ in range(warmup):
            self._step()

    def burst(self) -> None:
        import time

        from torch.profiler import ProfilerActivity, profile

        settle_with(self._step, SETTLE_S)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(BURST):
                self._step()
            self.wall += time.perf_counter() - start
        self.steps += BURST
        for event in prof.events():
            names = [event.name]
            parent = event.cpu_parent
            while parent is not None:
                names.append(parent.name)
                parent = parent.cpu_parent
            if any(n.startswith("Optimizer.") for n in names):  # Optimizer.step#Adam.step, Optimizer.zero_grad#...
                key = (OPTIMIZER, "")
            elif any(mark in n for n in names for mark in _TORCH_LOSS):
                key = (LOSS, "")
            else:
                backward = any(n.startswith("autograd::engine::evaluate_function") for n in names)
                key = (family(event.name), "backward" if backward else "forward")
            self.totals[key] += event.self_cpu_time_total


def side_by_side(bridge: dict[tuple[str, str], float], steps: int, torch_: TorchProfile) -> str:
    """Rows ``family / pass | bridge ms | torch ms | bridge / torch`` per step, largest bridge first."""
    lines = ["\nbridge (onnxruntime kernel time) beside eager torch (profiler self time), per step",
             f"{'':32} {'bridge ms':>10} {'torch ms':>10} {'ratio':>7}"]
    rows = sorted(set(bridge) | set(torch_.totals), key=lambda key: -bridge.get(key, 0.0))
    for key in rows + [("all", "")]:
        ours = (sum(bridge.values()) if key[0] == "all" else bridge.get(key, 0.0)) / steps / 1e3
        theirs = (sum(torch_.totals.values()) if key[0] == "all" else torch_.totals.get(key, 0.0)) / torch_.steps / 1e3
        ratio = f"{ours / theirs:7.2f}" if theirs else f"{'-':>7}"
        lines.append(f"{' / '.join(k for k in key if k):32} {ours:10.2f} {theirs:10.2f} {ratio}")
    lines.append(f"eager torch's profiled steps: {torch_.wall / torch_.steps * 1e3:.1f} ms wall each")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--graph", type=Path, help="a saved training graph of this model (its state beside it, "
                                                   "<graph>.state.npz); skips export and conversion")
    parser.add_argument("--save", type=Path, help="save the converted graph (and <graph>.state.npz) here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--torch", action="store_true", help="also profile eager torch's step; print both by op family")
    args = parser.parse_args(argv)
    bench = MODELS[args.model]()
    if args.graph:
        model = onnx.load(str(args.graph))
        state = dict(np.load(str(args.graph) + ".state.npz"))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            model, state = training_graph(args.model, Path(tmp))
    if args.save:
        onnx.save(model, str(args.save))
        np.savez(str(args.save) + ".state.npz", **state)
    theirs = TorchProfile(args.model, args.threads, args.warmup) if args.torch else None
    times = kernel_times(model, state, bench.inputs, bench.target, args.threads, args.warmup, args.steps,
                         theirs.burst if theirs else None)
    print(report(model, times, args.steps, args.top))
    if theirs:
        print(side_by_side(bridge_families(model, times), args.steps, theirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
