"""Where a training step's time goes: onnxruntime's profiler, by op type and by phase.

    python benchmarks/profile_step.py resnet18                 # export + convert, then profile
    python benchmarks/profile_step.py resnet18 --graph g.onnx  # reuse a saved training graph
    python benchmarks/profile_step.py small_cnn --save g.onnx  # keep the converted graph

The model is one of benchmarks/models.py (same batch, loss ``ce``, Adam). The graph runs in
onnxruntime as ``bridge.Trainer`` and benchmarks/run.py run it (``TrainingSession``'s session
options, ``--threads`` intra-op threads, no ``grad_*`` outputs) with ``enable_profiling``; after ``--warmup`` steps, ``--steps`` steps are
profiled. Each node's kernel time is summed over those steps and grouped by op type, by the
node's ``bridge.phase`` (forward, loss, backward, optimizer) and by both; the tables print the
milliseconds per step and the share of all kernel time.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this checkout's bridge, not an installed one
from models import MODELS  # noqa: E402


def training_graph(name: str, workdir: Path) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Export and convert benchmark model ``name``; the graph and its initial state."""
    import bridge

    bench = MODELS[name]()
    tm = bridge.to_training_onnx(str(bench.export(workdir / f"{name}.onnx")), loss="ce", optim="adam",
                                 optim_options={"lr": 1e-3})
    return tm.model, tm.initial_state()


def kernel_times(model: onnx.ModelProto, state: dict[str, np.ndarray], feed: dict[str, np.ndarray],
                 target: np.ndarray, threads: int, warmup: int, steps: int) -> dict[str, float]:
    """Microseconds of kernel time per node name, summed over ``steps`` steps after ``warmup``."""
    import onnxruntime as ort

    from bridge.runtime import is_gradient, outputs_dropped, session_options

    options = session_options(threads)  # as bridge.runtime runs a step
    options.enable_profiling = True
    with tempfile.TemporaryDirectory() as tmp:
        options.profile_file_prefix = str(Path(tmp) / "profile")
        with outputs_dropped(model, is_gradient):  # as TrainingSession(gradients=False) and bridge.Trainer run it
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        values = {**state, **feed, "target": target}
        inputs = {value.name: values[value.name] for value in session.get_inputs()}
        for _ in range(warmup + steps):
            session.run(None, inputs)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    after = runs[warmup - 1] if warmup else -1
    times: dict[str, float] = defaultdict(float)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] > after:
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
    times = kernel_times(model, state, bench.inputs, bench.target, args.threads, args.warmup, args.steps)
    print(report(model, times, args.steps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
