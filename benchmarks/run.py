"""Regenerate benchmarks/RESULTS.md's figures from one run: step time, conversion, compile, memory, data-parallel.

A top table of every model (conversion time, node count against onnxsim's, step time per backend against
eager torch, compile time, step peak memory against torch's), the tables behind it, conversion time
against depth, data-parallel throughput and conversion memory, all measured in this run.

    python benchmarks/run.py --max-load 100 --onnxsim-python <onnxsim venv>/bin/python   # rewrites RESULTS.md
    python benchmarks/run.py --all                   # also torch.compile
    python benchmarks/run.py --models mlp --backends bridge-ort torch --sections step --no-write

Per model (benchmarks/models.py): the module is exported (legacy exporter, every weight kept) and
converted in a child process (alone in its process: the time of its ``import torch`` + ``import bridge.api``
and, separately, of the conversion after them, and the peak RSS; the fastest of ``--convert-runs``); with
``--onnxsim-python``, onnxsim's Adam step of the same module is built and counted (benchmarks/graph_size.py);
the compiled backends are compiled (timed); then every backend gets ``--warmup`` steps, then ``--rounds``
rounds; in each, every backend in turn (the order rotates each round) runs untimed steps for ``--settle``
seconds (at least one), then ``--burst`` timed steps, whose median is its time in that round. All backends of a model, at
``--threads`` and at one thread, run in the same rounds, so they see the same machine load. The settling
matters: right after another backend, that backend's worker threads still spin for a while
(onnxruntime's pool, torch's OpenMP team, another process's pool) and hold the cores. Reported: medians,
the spread (25th-75th percentile), and the median of per-round ratios to eager torch at the same thread
count (< 1: faster than torch); the load average before and after. The run is refused when the 1-minute
load average is above ``--max-load`` before it starts.

Backends at ``--threads``: ``bridge-ort`` (bridge's training graph in onnxruntime), ``bridge-iree`` (the
same graph compiled by IREE), ``torch`` (eager: forward, loss, backward, ``torch.optim.Adam`` step),
``torch-compile`` (``torch.compile`` of the module), ``ort-training`` (onnxruntime-training 1.19.2's
artifacts, run by benchmarks/ort_training_child.py in the venv given by ``--ort-training-python``). At one
thread: ``bridge-ort@1``, ``bridge-onnx-mlir`` (the graph converted for onnx-mlir, ``target="onnx-mlir"``,
compiled by onnx-mlir for this CPU, ``target_cpu="native"``, which runs on one thread:
it is built without OpenMP; present when ``bridge.compile`` has the backend and ``ONNX_MLIR_HOME`` names
the install) and ``torch@1``. Every backend trains with Adam (lr 1e-3; onnxruntime-training: AdamW, its
only Adam) on the same fixed batch. A backend that cannot be set up is skipped with a note.

Sections ``distributed`` (benchmarks/bench_distributed.py) and ``memory`` (benchmarks/conversion_memory.py,
all layers trained and the first 5 of 6 frozen) run those scripts in child processes; ``step-memory``
(benchmarks/step_memory.py) measures one step's peak memory per model and backend on the step section's
graphs, and in onnxruntime on ``memory="min"`` graphs; ``depth`` converts benchmarks/models.py's ``STACKS`` at
``--depths`` blocks, each in a fresh process, and fits a line through the times (seconds per block).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from graph_size import onnxsim_counts, with_loss  # noqa: E402
from models import MODELS, STACKS, BenchModel, torch_loss  # noqa: E402
from step_memory import BACKENDS as STEP_MEMORY_BACKENDS  # noqa: E402
from step_memory import measure as measure_step_memory  # noqa: E402
from step_memory import step_peak_mib  # noqa: E402
from step_memory import table as step_memory_table  # noqa: E402

THREADED = ("bridge-ort", "bridge-iree", "torch", "torch-compile", "ort-training")
ONE_THREAD = ("bridge-ort@1", "bridge-onnx-mlir", "torch@1")
BACKENDS = THREADED + ONE_THREAD
DEFAULT_BACKENDS = ("bridge-ort", "bridge-iree", "torch", *ONE_THREAD)
DEFAULT_MODELS = ("mlp", "small_cnn", "resnet18", "mobilenet_v3_small", "bert_tiny", "gpt2_tiny")
SECTIONS = ("step", "depth", "distributed", "memory", "step-memory")
DEPTHS = (4, 8, 16, 32)
PHASES = ("forward", "loss", "backward", "optimizer")
RESULTS, RESULTS_JSON, PLOT = HERE / "RESULTS.md", HERE / "results.json", HERE / "step_time.png"
BEGIN, END = "<!-- results:begin (python benchmarks/run.py writes this section) -->", "<!-- results:end -->"
LR = 1e-3
Step = Callable[[], object]  # one training step; a float it returns is its own timing (a child process)


def reference(backend: str) -> str:
    """The eager torch backend a backend's ratio is taken against: torch at the same thread count."""
    return "torch@1" if backend in ONE_THREAD else "torch"


def convert_in_child(source: Path, out: Path, compiled_targets: Sequence[str] = ()) -> dict:
    """Convert ``source`` in a fresh process: the time of ``import torch`` + ``import bridge.api`` there
    (``import_s``, what any torch user's process pays once), the time of ``to_training_onnx`` after them
    (``convert_s``, with the imports torch itself makes on first use, such as ``torch._dynamo``; ``convert_cpu_s``:
    its CPU time, all threads, which a loaded machine moves less), the RSS after
    ``import bridge`` (lazy: no torch yet) and the peak RSS from there (Linux's VmHWM, reset after that import;
    ``ru_maxrss`` would carry the parent's peak across exec). The same process then converts ``source`` for each
    of ``compiled_targets`` (untimed) and saves that training graph at ``target_graph(out, target)``."""
    targets = "".join(f"""
onnx.save(bridge.to_training_onnx({str(source)!r}, loss="ce", optim="adam", optim_options={{"lr": {LR}}},
                                  target={target!r}).model, {str(target_graph(out, target))!r})
""" for target in compiled_targets)
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
imported, imported_cpu = time.perf_counter(), time.process_time()
tm = bridge.to_training_onnx({str(source)!r}, loss="ce", optim="adam", optim_options={{"lr": {LR}}})
done, done_cpu = time.perf_counter(), time.process_time()
peak = status("VmHWM")
import numpy as np
tm.save({str(out)!r})
np.savez({str(out) + '.state.npz'!r}, **tm.initial_state())
import onnx
{targets}
print(json.dumps({{"import_s": imported - start, "convert_s": done - imported, "convert_cpu_s": done_cpu - imported_cpu,
                  "peak_rss_mb": peak,
                  "import_rss_mb": base}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE.parent)
    if done.returncode:
        raise RuntimeError(f"conversion of {source.name} failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fastest_conversion(source: Path, out: Path, runs: int, compiled_targets: Sequence[str] = ()) -> dict:
    """``convert_in_child``'s figures of the fastest of ``runs`` conversions, each in a fresh process; the first
    also writes the graphs converted for ``compiled_targets``."""
    return min((convert_in_child(source, out, compiled_targets if run == 0 else ()) for run in range(runs)),
               key=lambda figures: figures["convert_s"])


def nodes_per_phase(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        phase = {p.key: p.value for p in node.metadata_props}.get("bridge.phase", "?")
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def torch_stepper(module: torch.nn.Module, bench: BenchModel, threads: int | None = None) -> Callable[[], None]:
    """Eager torch's step: forward, loss, backward, ``torch.optim.Adam``; ``threads``: set before each step
    (torch's thread count is per process, and the one-thread and threaded torch steps share it)."""
    inputs = [torch.from_numpy(v) for v in bench.inputs.values()]
    target = torch.from_numpy(bench.target)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)

    def step():
        if threads is not None:
            torch.set_num_threads(threads)
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


def onnx_mlir_available() -> bool:
    """``bridge.compile`` has an onnx-mlir backend in this tree."""
    from bridge.tools import compile as compile_tool

    return "onnx-mlir" in compile_tool.BACKENDS


def target_graph(training: Path, target: str) -> Path:
    """Where the conversion child saves the graph converted for ``target``, beside ``training``."""
    return training.with_name(training.name.replace(".train.onnx", f".{target}.train.onnx"))


def compiled_stepper(bench: BenchModel, training: Path, state: dict, backend: str, name: str,
                     notes: list[str], extra: dict) -> Step | None:
    """The step of ``training`` compiled by ``backend`` (``bridge.compile``, no ``grad_*`` outputs, as
    ``bridge.Trainer`` compiles), its compile time in ``extra[name + "_compile_s"]``; None with a note if it fails.
    Each backend compiles the graph converted for it (``target=backend``, what docs/onnx-mlir.md tells a user to
    convert: ``target_graph``, from the same source and with the same state); onnx-mlir for this machine's CPU
    (``target_cpu="native"``) as IREE does by default and as onnxruntime picks its kernels: at its default CPU
    onnx-mlir emits no AVX; both with ``in_place=True`` (IREE: the state no later read needs updated in its own
    buffers; onnx-mlir: each old state array released once the last piece reading it has run). The compiled
    module is saved beside ``training`` for the step-memory section."""
    import bridge

    try:
        options: dict[str, str | bool] = {"in_place": True}
        graph = target_graph(training, backend)
        if backend == "onnx-mlir":
            options["target_cpu"] = "native"
        start = time.perf_counter()
        compiled = bridge.compile(graph, backend=backend, gradients=False, **options)
        session = compiled.session(state)
        extra[f"{name}_compile_s"] = time.perf_counter() - start
        compiled.save(f"{training}.{backend}")  # where benchmarks/step_memory.py finds it
    except Exception as exc:  # noqa: BLE001 - a benchmark reports a failing backend and goes on
        notes.append(f"{bench.name}: bridge-{backend} skipped: {(str(exc).splitlines() or [type(exc).__name__])[0][:200]}")
        return None
    return lambda: session.step(bench.inputs, bench.target)


def compiled_targets(args: argparse.Namespace) -> list[str]:
    """The targets whose graphs the compiled step columns compile."""
    return [target for name, target in (("bridge-iree", "iree"), ("bridge-onnx-mlir", "onnx-mlir"))
            if name in args.backends and (target == "iree" or wants_onnx_mlir(args))]


def wants_onnx_mlir(args: argparse.Namespace) -> bool:
    """The step section has an onnx-mlir column: the backend asked for and present in this tree."""
    return "bridge-onnx-mlir" in args.backends and onnx_mlir_available()


def steppers(bench: BenchModel, training: Path, args: argparse.Namespace, notes: list[str], extra: dict,
             children: list[subprocess.Popen]) -> dict[str, Step]:
    """One ``step()`` per backend that could be set up; a note for each that could not."""
    from bridge.training.runtime import TrainingSession

    backends, threads = args.backends, args.threads
    state = dict(np.load(str(training) + ".state.npz"))
    result: dict[str, Step] = {}
    for name, count in (("bridge-ort", threads), ("bridge-ort@1", 1)):
        if name in backends:  # as bridge.Trainer runs it
            session = TrainingSession(training, state, threads=count, gradients=False)
            result[name] = lambda session=session: session.step(bench.inputs, bench.target)
    for backend in compiled_targets(args):
        step = compiled_stepper(bench, training, state, backend, backend.replace("-", "_"), notes, extra)
        if step is not None:
            result[f"bridge-{backend}"] = step
    for name, count in (("torch", threads), ("torch@1", 1)):
        if name in backends:
            result[name] = torch_stepper(copy.deepcopy(bench.module).train(), bench, count)
    if "torch-compile" in backends:
        try:
            compiled = torch_stepper(torch.compile(copy.deepcopy(bench.module).train()), bench, threads)
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
    """Median and quartiles per backend, and the median per-round ratio to torch at the same thread count."""
    summary = {}
    for name, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        entry = {"median_ms": 1e3 * statistics.median(values), "q1_ms": 1e3 * q1, "q3_ms": 1e3 * q3}
        torch_times = times.get(reference(name))
        if torch_times is not None and name != reference(name):
            entry["ratio_to_torch"] = statistics.median(a / b for a, b in zip(values, torch_times, strict=True))
        summary[name] = entry
    return summary


def onnxsim_nodes(bench: BenchModel, python: str, workdir: Path, notes: list[str]) -> dict[str, int] | None:
    """Nodes per phase of onnxsim's Adam step of ``bench`` (benchmarks/graph_size.py's, in the venv of ``python``);
    None with a note where onnxsim's step does not build."""
    try:
        counts = onnxsim_counts(python, with_loss(bench, workdir / f"{bench.name}.loss.onnx"))
    except Exception as exc:  # noqa: BLE001 - onnxsim fails on some models: the table says so and goes on
        notes.append((str(exc).splitlines() or [f"onnxsim's step of {bench.name} did not build"])[0][:300])
        return None
    return {phase: sum(ops.values()) for phase, ops in counts.items()}


def frozen_batch_norm_nodes(source: Path) -> dict[str, int]:
    """Nodes of the step converted with ``batch_norm="frozen"`` (BatchNorm as onnxsim trains it: running statistics,
    not updated), for the default target and for ``plain`` (no target's measured forms)."""
    import bridge

    return {target: len(bridge.to_training_onnx(str(source), loss="ce", optim="adam", optim_options={"lr": LR},
                                                batch_norm="frozen", target=target).model.graph.node)
            for target in ("onnxruntime", "plain")}


def like_for_like_table(results: list[dict]) -> list[str]:
    """Node counts against onnxsim's with BatchNorm frozen on bridge's side, for the models onnxsim's step builds."""
    rows = [r for r in results if r.get("frozen_nodes")]
    if not rows:
        return []
    lines = ["### Nodes like for like with onnxsim", "",
             "onnxsim trains BatchNorm in inference form (the running statistics normalize and do not move); bridge "
             "does that with `to_training_onnx(..., batch_norm=\"frozen\")`. **plain**: `target=\"plain\"`, the "
             "canonical graph without a runtime's measured forms (the onnxruntime target computes a Conv's input "
             "gradient as MatMuls, for example). In brackets: the ratio to onnxsim's nodes.", "",
             "| model | onnxsim | bridge | bridge, BatchNorm frozen | bridge plain, BatchNorm frozen |",
             "|---|---|---|---|---|"]
    for r in rows:
        theirs = sum(r["onnxsim_nodes"].values())
        cells = [sum(r["nodes"].values()), r["frozen_nodes"]["onnxruntime"], r["frozen_nodes"]["plain"]]
        lines.append(f"| {r['model']} | {theirs} | " + " | ".join(f"{n} ({n / theirs:.2f}x)" for n in cells) + " |")
    return [*lines, ""]


def bench_model(name: str, args: argparse.Namespace, workdir: Path, notes: list[str]) -> dict:
    """Conversion, graph size (onnxsim's too, given ``--onnxsim-python``), compile and step time of model ``name``;
    its training graph stays in ``workdir`` as ``<name>.train.onnx``, with the compiled modules beside it."""
    bench = MODELS[name]()
    source = bench.export(workdir / f"{name}.onnx")
    training = workdir / f"{name}.train.onnx"
    conversion = fastest_conversion(source, training, args.convert_runs, compiled_targets(args))
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
        torch.set_num_threads(args.threads)
    weights_mb = sum(p.numel() * p.element_size() for p in bench.module.parameters()) / 2**20
    if args.onnxsim_python is not None:
        extra["onnxsim_nodes"] = onnxsim_nodes(bench, args.onnxsim_python, workdir, notes)
        if extra["onnxsim_nodes"]:
            extra["frozen_nodes"] = frozen_batch_norm_nodes(source)
    print(f"{name}: " + ", ".join(f"{b} {s['median_ms']:.1f} ms" for b, s in summary.items()), flush=True)
    return {"model": name, "weights_mb": weights_mb, "nodes": nodes_per_phase(model), **conversion, **extra,
            "steps": summary}


def depth_rows(stacks: list[str], depths: list[int], workdir: Path, runs: int) -> list[dict]:
    """Conversion time (the fastest of ``runs``, each in a fresh process) and node count of every stack of
    benchmarks/models.py's ``STACKS`` at every depth."""
    rows = []
    for stack in stacks:
        for blocks in depths:
            bench = STACKS[stack](blocks)
            training = workdir / f"{bench.name}.train.onnx"
            conversion = fastest_conversion(bench.export(workdir / f"{bench.name}.onnx"), training, runs)
            nodes = len(onnx.load(str(training), load_external_data=False).graph.node)
            rows.append({"stack": stack, "blocks": blocks, "nodes": nodes,
                         **{key: conversion[key] for key in ("convert_s", "convert_cpu_s")}})
            print(f"{bench.name}: convert {conversion['convert_s']:.2f} s, {nodes} nodes", flush=True)
    return rows


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """The least-squares line through the points (``xs``, ``ys``): its slope and intercept."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def child_env() -> dict[str, str]:
    """The environment of the benchmark scripts run as children: bridge importable from this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}


def distributed_rows(steps: int) -> list[str]:
    """The table rows benchmarks/bench_distributed.py prints (1, 2 and 4 ranks of its mlp and cnn)."""
    done = subprocess.run([sys.executable, str(HERE / "bench_distributed.py"), "--steps", str(steps)],
                          capture_output=True, text=True, env=child_env(), cwd=HERE.parent)
    if done.returncode:
        raise RuntimeError(f"bench_distributed.py failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]


def memory_figures(frozen: int) -> dict:
    """benchmarks/conversion_memory.py's figures (a 100.7M-parameter MLP) with the first ``frozen`` layers frozen."""
    done = subprocess.run([sys.executable, str(HERE / "conversion_memory.py"), "--frozen", str(frozen), "--json"],
                          capture_output=True, text=True, env=child_env(), cwd=HERE.parent)
    if done.returncode:
        raise RuntimeError(f"conversion_memory.py failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return {"frozen": frozen, **json.loads(done.stdout.strip().splitlines()[-1])}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _onnx_mlir_version() -> str | None:
    home = os.environ.get("ONNX_MLIR_HOME")
    if not home or not onnx_mlir_available():
        return None
    try:
        done = subprocess.run([str(Path(home) / "bin" / "onnx-mlir"), "--version"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def machine(args: argparse.Namespace, argv: list[str]) -> dict:
    """What the header reports about the machine and the run (the load average is added around the run)."""
    import onnxruntime

    versions = {"python": platform.python_version(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__}
    try:
        versions["iree"] = importlib.metadata.version("iree-base-compiler")
    except importlib.metadata.PackageNotFoundError:
        pass
    onnx_mlir = _onnx_mlir_version()
    if onnx_mlir:
        versions["onnx-mlir"] = onnx_mlir
    home = os.environ.get("ONNX_MLIR_HOME")
    command = " ".join(["python benchmarks/run.py", *argv])
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": _cpu_model(), "cores": os.cpu_count(),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "threads": args.threads, "convert_runs": args.convert_runs, "versions": versions,
            "command": f"ONNX_MLIR_HOME={home} {command}" if home else command}


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _step_table(results: list[dict], backends: list[str], title: str) -> list[str]:
    """Median step time (spread) per backend, then each non-torch backend's ratio to torch."""
    shown = [b for b in backends if any(b in r["steps"] for r in results)]
    if not shown:
        return []
    label = {b: b.removesuffix("@1") for b in shown}
    others = [b for b in shown if b != reference(b)]
    lines = [title, "", "| model | " + " | ".join(f"{label[b]} ms" for b in shown) + " | "
             + " | ".join(f"{label[b]} / torch" for b in others) + " |", "|---" * (1 + len(shown) + len(others)) + "|"]
    for r in results:
        cells = []
        for b in shown:
            s = r["steps"].get(b)
            cells.append(f"{s['median_ms']:.1f} ({s['q1_ms']:.1f}-{s['q3_ms']:.1f})" if s else "-")
        ratios = [f"{r['steps'][b]['ratio_to_torch']:.2f}" if "ratio_to_torch" in r["steps"].get(b, {}) else "-"
                  for b in others]
        lines.append(f"| {r['model']} | " + " | ".join(cells + ratios) + " |")
    return lines + [""]


def _joined(values: list[str]) -> str:
    """Cells of one column group (``a / b / c``), or ``-`` where none was measured."""
    return "-" if all(v == "-" for v in values) else " / ".join(values)


def _memory_ratios(figures: dict, model: str) -> str:
    """Each bridge backend's memory figure for ``model`` over torch's, joined; ``-`` where one is missing."""
    theirs = figures.get((model, "torch"))
    return _joined([f"{figures[model, b] / theirs:.2f}" if theirs and (model, b) in figures else "-"
                    for b in ("bridge-ort", "bridge-iree", "bridge-onnx-mlir")])


def summary_table(results: list[dict], step_memory: list[dict] | None) -> list[str]:
    """The top table: one row per model with its conversion time, node count (and its ratio to onnxsim's), step
    time per backend against eager torch, compile times, and step memory against torch's: the step's own peak, and
    that peak with what the session holds between steps beyond its state."""
    rows = [r for r in step_memory or [] if r["memory"] in ("-", "default")]
    peaks = {(r["model"], r["backend"]): r["peak_mib"] for r in rows}
    with_held = {(r["model"], r["backend"]): step_peak_mib(r) for r in rows}
    lines = ["| model | convert s | nodes (x onnxsim) | step / torch: onnxruntime / IREE (2 threads) / onnx-mlir (1 "
             "thread) | torch step ms: 2 / 1 threads | compile s: IREE / onnx-mlir | torch step peak MiB: peak / + held "
             "| step peak / torch: onnxruntime / IREE / onnx-mlir | peak + held / torch: onnxruntime / IREE / onnx-mlir |",
             "|---" * 9 + "|"]
    for r in results:
        steps = r["steps"]
        nodes = sum(r["nodes"].values())
        onnxsim = sum(r["onnxsim_nodes"].values()) if r.get("onnxsim_nodes") else None
        ratios = _joined([f"{steps[b]['ratio_to_torch']:.2f}" if "ratio_to_torch" in steps.get(b, {}) else "-"
                          for b in ("bridge-ort", "bridge-iree", "bridge-onnx-mlir")])
        torch_ms = _joined([f"{steps[b]['median_ms']:.1f}" if b in steps else "-" for b in ("torch", "torch@1")])
        compiles = _joined([f"{r[key]:.1f}" if key in r else "-" for key in ("iree_compile_s", "onnx_mlir_compile_s")])
        memory = [_memory_ratios(figures, r["model"]) for figures in (peaks, with_held)]
        torch_peaks = _joined([f"{figures[r['model'], 'torch']:.1f}" if (r["model"], "torch") in figures else "-"
                               for figures in (peaks, with_held)])
        lines.append(f"| {r['model']} | {r['convert_s']:.2f} | {nodes}" + (f" ({nodes / onnxsim:.2f}x)" if onnxsim else "")
                     + f" | {ratios} | {torch_ms} | {compiles} | {torch_peaks} | {memory[0]} | {memory[1]} |")
    return lines


def depth_table(rows: list[dict]) -> list[str]:
    """Conversion time (node count) per stack and depth, and the least-squares line through the times and the
    node counts against the number of blocks."""
    depths = sorted({r["blocks"] for r in rows})
    lines = ["| model | " + " | ".join(f"{d} blocks" for d in depths) + " | s per block | intercept s | CPU s per "
             "block | nodes per block |", "|---" * (len(depths) + 5) + "|"]
    for stack in dict.fromkeys(r["stack"] for r in rows):
        measured = {r["blocks"]: r for r in rows if r["stack"] == stack}
        blocks = sorted(measured)
        slope, intercept = fit_line(blocks, [measured[b]["convert_s"] for b in blocks])
        cpu_slope, _ = fit_line(blocks, [measured[b]["convert_cpu_s"] for b in blocks])
        node_slope, _ = fit_line(blocks, [measured[b]["nodes"] for b in blocks])
        cells = [f"{measured[d]['convert_s']:.2f} s ({measured[d]['nodes']})" if d in measured else "-" for d in depths]
        lines.append(f"| {stack} | " + " | ".join(cells) + f" | {slope:.3f} | {intercept:.2f} | {cpu_slope:.3f} | "
                     f"{node_slope:.0f} |")
    return lines


def markdown(results: list[dict], info: dict, notes: list[str], distributed: list[str] | None = None,
             memory: list[dict] | None = None, step_memory: list[dict] | None = None,
             depth: list[dict] | None = None) -> str:
    """The generated section of RESULTS.md: the header, the top table, then a table per benchmark that ran."""
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    lines = [BEGIN, "## Current figures", "",
             f"- Command: `{info['command']}` ({info['wall_s'] / 60:.1f} min).",
             f"- Date: {info['date']}. Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']:.0f} GiB; "
             f"{versions}.",
             f"- Load average (1 / 5 / 15 min): {_load(info['load_before'])} before the run, "
             f"{_load(info['load_after'])} after it. The machine is shared: absolute times move with its load; "
             "the ratios compare backends measured in the same rounds.",
             f"- Threads: {info['threads']} for torch, onnxruntime and IREE in the first table; one thread in the "
             "second, where onnx-mlir (built without OpenMP, so always one thread) is compared with onnxruntime "
             "and torch at one thread."]
    if max(info["load_before"][0], info["load_after"][0]) > info["cores"]:
        lines.append("- The load average exceeded the core count: eager torch's threaded step suffers most (its OpenMP "
                     "threads wait for each other when one is descheduled), so the threaded table's ratios to torch "
                     "flatter the other backends; the one-thread table's hold better.")
    lines.append("")
    if results:
        runs = f" (the fastest of {info['convert_runs']} runs)" if info["convert_runs"] > 1 else ""
        lines += ["### All models", "",
                  f"**convert s**: `to_training_onnx` in a fresh process after `import torch, bridge.api`{runs}. **nodes**: the whole training step (forward, loss, backward, Adam); "
                  "onnxsim's: its Adam step of the same module with a one-hot cross-entropy appended "
                  "(benchmarks/graph_size.py), where it builds. **step / torch**: the median per-round ratio to eager "
                  "torch at the same thread count (< 1: faster than torch). **step peak**: one step's peak RSS above "
                  "the RSS before it; **peak + held**: with what the session holds between steps beyond its state (a "
                  "second set of state buffers, a runtime's pool of the step's buffers) (benchmarks/step_memory.py, "
                  "default graphs; onnxruntime as `bridge.Trainer` runs it, IREE and onnx-mlir compiled with `in_place=True`, in the "
                  "step column too). The tables below give the figures "
                  "behind each column.", "", *summary_table(results, step_memory), ""]
        lines += ["Median step time in ms (25th-75th percentile) and the median per-round ratio to eager torch at "
                  "the same thread count (< 1: faster than torch). Adam, lr 1e-3, the batch of benchmarks/models.py.", ""]
        lines += _step_table(results, list(THREADED), f"### Step time, {info['threads']} threads")
        lines += _step_table(results, list(ONE_THREAD), "### Step time, one thread")
        onnxsim = any(r.get("onnxsim_nodes") for r in results)
        compilers = [(key, label) for key, label in (("iree_compile_s", "IREE compile s"),
                                                     ("onnx_mlir_compile_s", "onnx-mlir compile s"),
                                                     ("torch_compile_s", "torch.compile first step s"))
                     if any(key in r for r in results)]
        lines += ["### Conversion, compile time and graph size", "",
                  "A fresh process per conversion. **import s**: `import torch` + `import bridge.api` there; "
                  "**convert s**: `to_training_onnx` after them (with the modules torch imports on first use). Peak "
                  "RSS of that process, its RSS after `import bridge` (lazy: no torch) in brackets. Compile: "
                  "`bridge.compile(..., gradients=False)` of the graph converted for that backend (`target=\"iree\"`, `target=\"onnx-mlir\"`; onnx-mlir with `target_cpu=\"native\"`), wall time.", "",
                  "| model | weights MB | import s | convert s | peak RSS MB | nodes: forward / loss / backward / "
                  "optimizer | " + ("onnxsim's nodes | " if onnxsim else "") + " | ".join(label for _, label in compilers)
                  + (" |" if compilers else ""), "|---" * (6 + onnxsim + len(compilers)) + "|"]
        for r in results:
            compiled = [f"{r[key]:.1f}" if key in r else "-" for key, _ in compilers]
            theirs = ([" / ".join(str(r["onnxsim_nodes"].get(p, 0)) for p in PHASES) if r.get("onnxsim_nodes") else "-"]
                      if onnxsim else [])
            lines.append(f"| {r['model']} | {r['weights_mb']:.1f} | {r['import_s']:.2f} | {r['convert_s']:.2f} | "
                         f"{r['peak_rss_mb']:.0f} ({r['import_rss_mb']:.0f}) | "
                         + " / ".join(str(r["nodes"].get(p, 0)) for p in PHASES) + " | "
                         + " | ".join(theirs + compiled) + (" |" if theirs + compiled else ""))
        lines.append("")
        lines += like_for_like_table(results)
    if step_memory:
        lines += ["### Step memory", "",
                  "benchmarks/step_memory.py: the peak RSS of one training step above the RSS before it, each in a "
                  "fresh process after one warm-up step (glibc's mmap threshold fixed at 64 KiB, so freed blocks go "
                  "back to the system; onnxruntime's CPU arena off, except in `bridge-ort-arena`: the growth over the "
                  "first 3 steps with it on). `bridge-ort-in-place`: `TrainingSession(in_place=True)`, the step in pieces, "
                  "each old state array released after the last piece that reads it. Adam; eager torch's gradients are "
                  "freed after its step. `memory=min`: "
                  "graphs converted with `to_training_onnx(..., memory=\"min\")`. **held**: the memory allocated between steps "
                  "beyond what it was before the session was built, less the state's bytes (a second set of state buffers, a "
                  "runtime's pool); **peak + held**: the step's peak beyond the state. **footprint**: that step's peak "
                  "RSS above the RSS before the session (torch: its copy of the module and its optimizer) was built, after "
                  "the imports.",
                  "",
                  *step_memory_table(step_memory), ""]
    if depth:
        lines += ["## Conversion time vs depth", "",
                  "benchmarks/models.py's `STACKS`: a transformer (pre-norm blocks of causal self-attention and a GELU "
                  "MLP, width 64) and a resnet (basic blocks of 16 channels) of 4 to 32 identical blocks, each converted "
                  "as in the top table (a fresh process, the time after the imports; in brackets the step's nodes). "
                  "The least-squares line through the times gives the seconds per block and the intercept (what does "
                  "not grow with depth, first-use imports included); through the conversions' CPU times (all threads), "
                  "the CPU seconds per block, which a loaded machine moves less.", "", *depth_table(depth), ""]
    if distributed:
        lines += ["## Data-parallel", "",
                  "benchmarks/bench_distributed.py: `DataParallelTrainer` in onnxruntime, Adam, weak scaling (32 "
                  "samples per rank and step), ranks on loopback gloo. Samples/s of the whole job, median step, the "
                  "share of the step in collectives (waiting for the slowest rank included) and the transfer share "
                  "(the same all-reduce right after a barrier). More ranks than cores oversubscribe them: those rows "
                  "measure contention.", "",
                  "| model (weights) | ranks | samples/s | speed-up | median step | in collectives | transfer only |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |", *distributed, ""]
    if memory:
        lines += ["## Conversion memory", "",
                  "benchmarks/conversion_memory.py: a 100.7M-parameter MLP (6 x Gemm 4096 x 4096 + bias), `mse` + "
                  "`sgd`, converted and saved in a fresh process; its peak RSS (`ru_maxrss`) against its RSS after "
                  "`import torch, bridge.api`.", "",
                  "| layers frozen | weights MiB | peak RSS MiB | above the import's RSS | convert s | convert + save s |",
                  "|---|---|---|---|---|---|"]
        for m in memory:
            above = m["peak_mib"] - m["import_mib"]
            lines.append(f"| {m['frozen']} of 6 | {m['weights_mib']:.0f} | {m['peak_mib']:.0f} | {above:.0f} MiB = "
                         f"{above / m['weights_mib']:.2f}x the weights | {m['convert_s']:.1f} | {m['total_s']:.1f} |")
        lines.append("")
    if notes:
        lines += ["Notes:", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(lines).rstrip("\n") + "\n" + END + "\n"


def write_results(section: str) -> None:
    """Replace the generated section of RESULTS.md (the text around it stays)."""
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
    backends = [b for b in BACKENDS if b != reference(b) and any(b in r["steps"] for r in results)]
    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(backends), 1)
    for i, b in enumerate(backends):
        values = [r["steps"].get(b, {}).get("ratio_to_torch", np.nan) for r in results]
        axis.bar(np.arange(len(results)) + i * width, values, width, label=b)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(np.arange(len(results)) + width * (len(backends) - 1) / 2, [r["model"] for r in results])
    axis.set_ylabel("step time / eager torch (same threads)")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=list(MODELS))
    parser.add_argument("--backends", nargs="*", default=list(DEFAULT_BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--all", action="store_true", help="every model of benchmarks/models.py (not only "
                        "DEFAULT_MODELS), and torch-compile")
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--burst", type=int, default=3, help="timed steps per backend per round")
    parser.add_argument("--settle", type=float, default=0.2,
                        help="seconds of untimed steps (at least one) before a backend's timed steps in each round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distributed-steps", type=int, default=30, help="timed steps per data-parallel run")
    parser.add_argument("--max-load", type=float, default=1.0, help="refuse to start above this 1-minute load average")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md, results.json and the plot")
    parser.add_argument("--onnxsim-python", help="the python of a venv with onnxsim: its step's node count beside "
                        "bridge's (left out without it)")
    parser.add_argument("--convert-runs", type=int, default=1, help="conversions per model, each in a fresh process; "
                        "the fastest is reported")
    parser.add_argument("--stacks", nargs="*", default=list(STACKS), choices=list(STACKS),
                        help="the stacked-block models of the depth section")
    parser.add_argument("--depths", nargs="*", type=int, default=list(DEPTHS), help="blocks per stack (depth section)")
    parser.add_argument("--ort-training-python", help="the python of a venv with onnxruntime-training 1.19.2 "
                        "(backend ort-training; skipped with a note without it)")
    args = parser.parse_args(argv)
    if args.rounds < 15:
        parser.error("--rounds must be at least 15 (medians of fewer are noise)")
    if args.burst < 1 or args.settle < 0:
        parser.error("--burst must be at least 1 and --settle at least 0")
    if args.convert_runs < 1:
        parser.error("--convert-runs must be at least 1")
    if "depth" in args.sections and (len(set(args.depths)) < 2 or min(args.depths) < 1):
        parser.error("--depths needs two different block counts of at least 1 (a slope needs two points)")
    if args.all:
        args.models = list(MODELS)
        args.backends = list(dict.fromkeys([*args.backends, "torch-compile"]))
    load_before = os.getloadavg()
    if load_before[0] > args.max_load:
        print(f"the machine is busy (load average {load_before[0]:.2f} > --max-load {args.max_load}); not measuring")
        return 2
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if "bridge-iree" in args.backends and "step" in args.sections:
        import iree.runtime

        iree.runtime.flags.parse_flags(f"--task_topology_max_group_count={args.threads}")
    notes: list[str] = []
    if "bridge-onnx-mlir" in args.backends and "step" in args.sections and not onnx_mlir_available():
        notes.append("bridge-onnx-mlir skipped: bridge.compile has no onnx-mlir backend in this tree")
    results, depth, step_memory = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if "step" in args.sections:
            results = [bench_model(name, args, workdir, notes) for name in args.models]
        if "step-memory" in args.sections:  # the step section's graphs and compiled modules, where it ran
            wanted = [*args.backends, "bridge-ort-in-place", "bridge-ort-arena"] if "bridge-ort" in args.backends else args.backends
            converted = {r["model"]: {"default": workdir / f"{r['model']}.train.onnx"} for r in results}
            step_memory, memory_notes = measure_step_memory(
                args.models, [b for b in wanted if b in STEP_MEMORY_BACKENDS], ["default"], args.threads, converted)
            if "bridge-ort" in args.backends:  # memory="min" in onnxruntime only: compiling again costs minutes
                rows, more_notes = measure_step_memory(args.models, ["bridge-ort"], ["min"], args.threads)
                step_memory = sorted(step_memory + rows, key=lambda row: args.models.index(row["model"]))
                memory_notes += more_notes
            notes += memory_notes
        if "depth" in args.sections:
            depth = depth_rows(args.stacks, sorted(set(args.depths)), workdir, args.convert_runs)
    distributed = distributed_rows(args.distributed_steps) if "distributed" in args.sections else None
    memory = [memory_figures(frozen) for frozen in (0, 5)] if "memory" in args.sections else None
    info = {**machine(args, argv), "load_before": load_before, "load_after": os.getloadavg(),
            "wall_s": time.perf_counter() - start}
    section = markdown(results, info, notes, distributed, memory, step_memory, depth)
    print(section)
    if not args.no_write:
        write_results(section)
        RESULTS_JSON.write_text(json.dumps({"machine": info, "results": results, "notes": notes,
                                                       "distributed": distributed, "memory": memory,
                                                       "step_memory": step_memory, "depth": depth}, indent=1))
        if results:
            plot(results, PLOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
