"""Step time and conversion cost, bridge vs PyTorch, measured side by side in one run.

    python benchmarks/run.py                       # every model, every backend, writes RESULTS.md
    python benchmarks/run.py --models mlp resnet18 --backends bridge-ort torch --rounds 20

Per model (benchmarks/models.py): the module is exported (legacy exporter, every weight kept) and
converted in a child process (alone in its process: the time of its ``import torch`` + ``import bridge.api``
and, separately, of the conversion after them, and the peak RSS); then every
backend gets ``--warmup`` steps, then ``--rounds`` rounds; in each, every backend in turn (the
order rotates each round) runs untimed steps for ``--settle`` seconds (at least one), then
``--burst`` timed steps, whose median is its time in that round; all backends see the same machine
load. The settling matters: right after another backend, that backend's worker threads still spin
for a while (onnxruntime's pool, torch's OpenMP team, another process's pool) and hold the cores,
and single alternating steps measured that interference, not the step (2026-12-01: torch's resnet18
step 116-125 ms right after a bridge step, 94-97 ms in a steady run; small_cnn's bridge step ~2x its
steady time for ~7 steps after an onnxruntime-training child's; benchmarks/RESULTS.md). Reported:
medians, the spread (25th-75th percentile), and the median of per-round ratios to eager torch
(< 1: faster than torch). Threads are fixed (torch, onnxruntime and IREE's task pool) and reported; the run is
refused when the 1-minute load average is above ``--max-load`` before it starts.

Backends: ``bridge-ort`` (bridge's training graph in onnxruntime), ``bridge-iree`` (the same graph
compiled by IREE), ``torch`` (eager: forward, loss, backward, ``torch.optim.Adam`` step),
``torch-compile`` (``torch.compile`` of the module, same optimizer; skipped with a note where it
fails), ``ort-training`` (onnxruntime-training 1.19.2's artifacts, fused com.microsoft gradient
kernels and its AdamW, run by benchmarks/ort_training_child.py in the venv given by
``--ort-training-python``; skipped with a note without one). Every backend trains with Adam (lr
1e-3; onnxruntime-training: AdamW, its only Adam) on the same fixed batch.

Graph sizes are reported next to the first landing's (``BEFORE_NODES``: the same models, measured
before issue 18's changes).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import MODELS, BenchModel, torch_loss  # noqa: E402

BACKENDS = ("bridge-ort", "bridge-iree", "torch", "torch-compile", "ort-training")
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- step-time:begin (benchmarks/run.py writes this section) -->", "<!-- step-time:end -->"
LR = 1e-3
# Nodes per phase (forward / loss / backward / optimizer) at the first landing (2026-11-30 11:31 UTC):
# the "before" column of the graph-size table. resnet18 and mobilenet_v3_small were then exported
# with tied BatchNorm weights (all 1 and 0, de-duplicated by the exporter: 30 trained tensors of
# resnet18's 62), see models._untie.
BEFORE_NODES = {"mlp": "11 / 22 / 41 / 89", "small_cnn": "12 / 22 / 102 / 89", "resnet18": "543 / 22 / 907 / 401",
                "mobilenet_v3_small": "1069 / 22 / 1918 / 1090"}
Step = Callable[[], object]  # one training step; a float it returns is its own timing (a child process)


def convert_in_child(source: Path, out: Path) -> dict:
    """Convert ``source`` in a fresh process: the time of ``import torch`` + ``import bridge.api`` there
    (``import_s``, what any torch user's process pays once), the time of ``to_training_onnx`` after them
    (``convert_s``, with the imports torch itself makes on first use, such as ``torch._dynamo``), the RSS after
    ``import bridge`` (lazy: no torch yet) and the peak RSS from there (Linux's VmHWM, reset after that import;
    ``ru_maxrss`` would carry the parent's peak across exec)."""
    code = f"""
import json, time
import bridge
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
start = time.perf_counter()
import torch
import bridge.api
imported = time.perf_counter()
tm = bridge.to_training_onnx({str(source)!r}, loss="ce", optim="adam", optim_options={{"lr": {LR}}})
done = time.perf_counter()
peak = status("VmHWM")
import numpy as np
tm.save({str(out)!r})
np.savez({str(out) + '.state.npz'!r}, **tm.initial_state())
print(json.dumps({{"import_s": imported - start, "convert_s": done - imported, "peak_rss_mb": peak,
                  "import_rss_mb": base}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode:
        raise RuntimeError(f"conversion of {source.name} failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def nodes_per_phase(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        phase = {p.key: p.value for p in node.metadata_props}.get("bridge.phase", "?")
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def torch_stepper(module: torch.nn.Module, bench: BenchModel) -> Callable[[], None]:
    inputs = [torch.from_numpy(v) for v in bench.inputs.values()]
    target = torch.from_numpy(bench.target)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)

    def step():
        optimizer.zero_grad()
        torch_loss(module(*inputs), target).backward()
        optimizer.step()

    return step


def ort_training_stepper(bench: BenchModel, python: str, workdir: Path, threads: int,
                         children: list[subprocess.Popen]) -> Step:
    """A child process of onnxruntime-training (benchmarks/ort_training_child.py) stepping on
    request; its step returns the time the child measured. The child is appended to ``children``."""
    source = bench.export(workdir / f"{bench.name}.training_mode.onnx", training=True)
    inputs = workdir / f"{bench.name}.inputs.npz"
    np.savez(inputs, **bench.inputs, target=bench.target)
    initializers = {t.name for t in onnx.load(str(source), load_external_data=False).graph.initializer}
    params = [name for name, _ in bench.module.named_parameters() if name in initializers]
    child = subprocess.Popen([python, str(HERE / "ort_training_child.py"), str(source), str(inputs),
                              str(workdir / f"{bench.name}.artifacts"), str(threads), str(LR), *params],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.append(child)
    if child.stdout.readline().strip() != "ready":
        child.kill()
        raise RuntimeError(child.stderr.read().strip().splitlines()[-1][-200:])  # the end names the op

    def step() -> float:
        child.stdin.write("step\n")
        child.stdin.flush()
        return float(child.stdout.readline())

    return step


def steppers(bench: BenchModel, training: Path, args: argparse.Namespace, notes: list[str], extra: dict,
             children: list[subprocess.Popen]) -> dict[str, Step]:
    """One ``step()`` per backend that could be set up; a note for each that could not."""
    import bridge
    from bridge.training.runtime import TrainingSession

    backends, threads = args.backends, args.threads
    state = dict(np.load(str(training) + ".state.npz"))
    result: dict[str, Step] = {}
    if "bridge-ort" in backends:
        session = TrainingSession(training, state, threads=threads, gradients=False)  # as bridge.Trainer runs
        result["bridge-ort"] = lambda: session.step(bench.inputs, bench.target)
    if "bridge-iree" in backends:
        try:
            start = time.perf_counter()
            iree = bridge.compile(training, gradients=False).session(state)  # as bridge.Trainer compiles
            extra["iree_compile_s"] = time.perf_counter() - start
            result["bridge-iree"] = lambda: iree.step(bench.inputs, bench.target)
        except Exception as exc:  # noqa: BLE001 - a benchmark reports a failing backend and goes on
            notes.append(f"{bench.name}: bridge-iree skipped: {str(exc).splitlines()[0][:200]}")
    if "torch" in backends:
        result["torch"] = torch_stepper(copy.deepcopy(bench.module).train(), bench)
    if "torch-compile" in backends:
        try:
            compiled = torch_stepper(torch.compile(copy.deepcopy(bench.module).train()), bench)
            start = time.perf_counter()
            compiled()
            extra["torch_compile_s"] = time.perf_counter() - start
            result["torch-compile"] = compiled
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{bench.name}: torch-compile skipped: {str(exc).splitlines()[0][:200]}")
    if "ort-training" in backends:
        if args.ort_training_python is None:
            notes.append(f"{bench.name}: ort-training skipped: no --ort-training-python (a venv with "
                         "onnxruntime-training 1.19.2, onnx 1.16 and torch)")
        elif bench.target.ndim > 1:
            notes.append(f"{bench.name}: ort-training skipped: its CrossEntropyLoss takes the classes on dim 1, "
                         "these [N, T, V] logits have them last")
        else:
            try:
                result["ort-training"] = ort_training_stepper(bench, args.ort_training_python, training.parent,
                                                              threads, children)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{bench.name}: ort-training skipped: {str(exc).splitlines()[0][:200]}")
    return result


def settle_with(step: Step, seconds: float) -> None:
    """Untimed steps until ``seconds`` have passed (at least one): the previous backend's spinning threads let
    go of the cores meanwhile."""
    start = time.perf_counter()
    step()
    while time.perf_counter() - start < seconds:
        step()


def measure(step_fns: dict[str, Step], rounds: int, warmup: int, burst: int = 3,
            settle: float = 0.2) -> dict[str, list[float]]:
    """Per round, every backend in turn (the order rotates each round): untimed steps until ``settle``
    seconds have passed (at least one), so that the previous backend's spinning threads have let go of
    the cores, then ``burst`` timed steps, whose median is the round's time. A step that returns a
    float (a child process's own measure) is timed by it."""
    names = list(step_fns)
    for name in names:
        for _ in range(warmup):
            step_fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            settle_with(step_fns[name], settle)
            timed = []
            for _ in range(burst):
                start = time.perf_counter()
                own = step_fns[name]()
                timed.append(own if isinstance(own, float) else time.perf_counter() - start)
            times[name].append(statistics.median(timed))
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    summary = {}
    for name, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        entry = {"median_ms": 1e3 * statistics.median(values), "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}
        if "torch" in times:
            entry["ratio_to_torch"] = statistics.median(a / b for a, b in zip(values, times["torch"]))
        summary[name] = entry
    return summary


def bench_model(name: str, args: argparse.Namespace, workdir: Path, notes: list[str]) -> dict:
    bench = MODELS[name]()
    source = bench.export(workdir / f"{name}.onnx")
    training = workdir / f"{name}.train.onnx"
    conversion = convert_in_child(source, training)
    model = onnx.load(str(training), load_external_data=False)
    extra: dict = {}
    children: list[subprocess.Popen] = []
    try:
        step_fns = steppers(bench, training, args, notes, extra, children)
        summary = summarise(measure(step_fns, args.rounds, args.warmup, args.burst, args.settle))
    finally:
        for child in children:
            child.stdin.close()
            child.wait(timeout=60)
    weights_mb = sum(p.numel() * p.element_size() for p in bench.module.parameters()) / 2**20
    print(f"{name}: " + ", ".join(f"{b} {s['median_ms']:.1f} ms" for b, s in summary.items()), flush=True)
    return {"model": name, "weights_mb": weights_mb, "nodes": nodes_per_phase(model), **conversion, **extra,
            "steps": summary}


def machine(threads: int, load: float) -> dict:
    import onnxruntime

    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": threads,
            "load_before": load, "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "command": " ".join(["python", *sys.argv])}


def markdown(results: list[dict], info: dict, notes: list[str]) -> str:
    backends = [b for b in BACKENDS if any(b in r["steps"] for r in results)]
    lines = [BEGIN, "## Step time (benchmarks/run.py)", "",
             f"{info['date']}, {info['cores']} cores ({info['cpu']}), {info['threads']} threads for torch, "
             f"onnxruntime and IREE; load average {info['load_before']:.2f} before the run; python "
             f"{info['python']}, torch {info['torch']}, onnxruntime {info['onnxruntime']}.",
             f"Command: `{info['command']}`.", "",
             "Median step time in ms (25th-75th percentile), and the median per-round ratio to eager torch "
             "(< 1: faster than torch).", "",
             "| model | " + " | ".join(backends) + " | " + " | ".join(f"{b} / torch" for b in backends if b != "torch") + " |",
             "|---" * (2 * len(backends)) + "|"]
    for r in results:
        cells = []
        for b in backends:
            s = r["steps"].get(b)
            cells.append(f"{s['median_ms']:.1f} ({s['q1_ms']:.1f}-{s['q3_ms']:.1f})" if s else "-")
        ratios = [f"{r['steps'][b]['ratio_to_torch']:.2f}" if b in r["steps"] and "ratio_to_torch" in r["steps"][b]
                  else "-" for b in backends if b != "torch"]
        lines.append(f"| {r['model']} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Conversion (a fresh process per model) and graph size. **import s**: `import torch` + "
              "`import bridge.api` in that process (paid once by any process that uses torch); **convert s**: "
              "`to_training_onnx` after them (with the modules torch imports on first use, `torch._dynamo` ~1 s). "
              "Peak RSS from `import bridge` on (lazy: no torch), that RSS in brackets.", "",
              "| model | weights MB | import s | convert s | peak RSS MB (after import) | nodes: forward / loss / "
              "backward / optimizer | before (first landing) |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["nodes"]
        lines.append(f"| {r['model']} | {r['weights_mb']:.1f} | {r['import_s']:.2f} | {r['convert_s']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} "
                     f"({r['import_rss_mb']:.0f}) | {n.get('forward', 0)} / {n.get('loss', 0)} / "
                     f"{n.get('backward', 0)} / {n.get('optimizer', 0)} | {BEFORE_NODES.get(r['model'], '-')} |")
    if notes:
        lines += ["", "Notes:", ""] + [f"- {note}" for note in notes]
    return "\n".join(lines + [END]) + "\n"


def write_results(section: str) -> None:
    """Replace this benchmark's section of RESULTS.md (other benchmarks keep theirs)."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    backends = [b for b in BACKENDS if b != "torch" and any(b in r["steps"] for r in results)]
    figure, axis = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(backends), 1)
    for i, b in enumerate(backends):
        values = [r["steps"].get(b, {}).get("ratio_to_torch", np.nan) for r in results]
        axis.bar(np.arange(len(results)) + i * width, values, width, label=b)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(np.arange(len(results)) + width * (len(backends) - 1) / 2, [r["model"] for r in results])
    axis.set_ylabel("step time / eager torch")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--burst", type=int, default=3, help="timed steps per backend per round")
    parser.add_argument("--settle", type=float, default=0.2,
                        help="seconds of untimed steps (at least one) before a backend's timed steps in each round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-load", type=float, default=1.0, help="refuse to start above this 1-minute load average")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md and the plot alone")
    parser.add_argument("--ort-training-python", help="the python of a venv with onnxruntime-training 1.19.2 "
                        "(backend ort-training; skipped with a note without it)")
    args = parser.parse_args(argv)
    if args.rounds < 15:
        parser.error("--rounds must be at least 15 (medians of fewer are noise)")
    if args.burst < 1 or args.settle < 0:
        parser.error("--burst must be at least 1 and --settle at least 0")
    load = os.getloadavg()[0]
    if load > args.max_load:
        print(f"the machine is busy (load average {load:.2f} > --max-load {args.max_load}); not measuring")
        return 2
    torch.set_num_threads(args.threads)
    if "bridge-iree" in args.backends:
        import iree.runtime

        iree.runtime.flags.parse_flags(f"--task_topology_max_group_count={args.threads}")
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_model(name, args, Path(tmp), notes) for name in args.models]
    info = machine(args.threads, load)
    section = markdown(results, info, notes)
    print(section)
    if not args.no_write:
        write_results(section)
        (HERE / "results.json").write_text(json.dumps({"machine": info, "results": results, "notes": notes}, indent=1))
        plot(results, HERE / "step_time.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
