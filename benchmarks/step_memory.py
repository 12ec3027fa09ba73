"""Peak memory of ONE training step per backend: process RSS above the session's own baseline.

    python benchmarks/step_memory.py --models small_cnn resnet18 --backends torch bridge-ort bridge-iree
    python benchmarks/step_memory.py --models mlp --memory default min --json

Per model (benchmarks/models.py) the module is exported and converted (Adam, lr 1e-3) in this process,
with each ``--memory`` setting of ``to_training_onnx``, and the compiled backends are compiled here too.
Each measurement then runs in a fresh child process: it builds the session, runs one warm-up step, resets
the process's peak RSS (``/proc/self/clear_refs`` with ``5`` resets ``VmHWM``), reads its RSS (the
baseline: weights, optimizer state, the runtime and everything the warm-up left), runs one step and
reports ``VmHWM`` minus that baseline: what the step itself adds at its peak. A session may keep memory between
steps beyond its state (a second set of state buffers, the runtime's pool of the step's buffers): that is in the
baseline, so the peak above it misses it. ``held_mib`` counts it: the anonymous RSS (memory allocated, not the
pages of the libraries a first step runs) at the baseline above that before the session (or torch's copy of the
module and its optimizer) was built, after the runtime's imports, less the state's own bytes (weights, buffers,
optimizer moments). "peak + held" is the honest step peak: all the memory beyond the state.
The footprint: the peak RSS of that step above the RSS before the session was built (the state, what the
session keeps, and the step's peak together).

The children run with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``): every larger
block is mapped on allocation and unmapped on free, so RSS follows the live memory. With glibc's default
(a threshold that rises after frees), freed blocks stay in the heap and the figure would depend on what
the warm-up left there. onnxruntime's CPU arena is off for the same reason (an arena keeps what the
warm-up step used, so the measured step would add nothing); ``bridge-ort-arena`` measures with it on, as
``bridge.Trainer`` runs a default graph (``swap_buffers=True``): the RSS growth over the first three steps, from
before the first. A ``memory="min"`` graph runs without the arena in bridge's sessions
(bridge/training/runtime.py), so both rows are that.

Backends: ``torch`` (eager: forward, loss, backward, ``torch.optim.Adam``, then the gradients set to None:
they count in the step, as bridge's do), ``bridge-ort`` (onnxruntime as ``bridge.Trainer`` runs it, without the
arena: no ``grad_*`` outputs, the updated state written into the session's second set of state buffers,
``swap_buffers=True``), ``bridge-ort-in-place`` (``TrainingSession(in_place=True)``: the step in pieces, each old
state array released once the last piece reading it has run), ``bridge-ort-arena`` (as ``bridge.Trainer`` runs it), ``bridge-iree``
(``bridge.compile(in_place=True)``: the state is updated in its own buffers) and ``bridge-onnx-mlir``
(``bridge.compile(in_place=True)``: the session releases each old state array once the last piece reading it has
run; present when ``ONNX_MLIR_HOME`` names an install; onnx-mlir compiles take minutes on the larger models). The
compiled backends run the graph converted for them (``target="iree"``, ``target="onnx-mlir"``), as a user converts it.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import MODELS, BenchModel, torch_loss  # noqa: E402

BACKENDS = ("torch", "bridge-ort", "bridge-ort-in-place", "bridge-ort-arena", "bridge-iree", "bridge-onnx-mlir")
BRIDGE_BACKENDS = BACKENDS[1:]
COMPILED = {"bridge-iree": "iree", "bridge-onnx-mlir": "onnx-mlir"}
MEMORY_SETTINGS = ("default", "min")
LR = 1e-3
ARENA_STEPS = 3  # bridge-ort-arena: the arena's growth over the first steps
MMAP_THRESHOLD = 65536  # bytes: glibc maps every larger block (see the module docstring)


def _status_mib(key: str) -> float:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def measure_step(step) -> dict[str, float]:
    """Run ``step`` once to warm up, reset the peak, read the baseline RSS, run ``step`` once more: ``peak_mib``
    is the peak RSS during that step above the baseline (``baseline_mib``; ``allocated_mib``: its anonymous
    part, the memory the process allocated, without the pages of libraries and files it has read)."""
    step()
    _reset_peak()
    baseline, allocated = _status_mib("VmRSS"), _status_mib("RssAnon")
    start, cpu_start = time.perf_counter(), time.process_time()
    step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"peak_mib": _status_mib("VmHWM") - baseline, "baseline_mib": baseline, "allocated_mib": allocated,
            "step_s": seconds, "step_cpu_s": cpu_seconds}


def import_runtime(backend: str) -> None:
    """Import what ``backend``'s session loads, so that the RSS read after it leaves the libraries out."""
    if backend == "torch":
        import torch  # noqa: F401
    elif backend in COMPILED:
        import bridge.tools.compile  # noqa: F401
        if backend == "bridge-iree":
            import iree.runtime  # noqa: F401
    else:
        import onnxruntime  # noqa: F401

        import bridge.training.runtime  # noqa: F401


def torch_step(bench: BenchModel, threads: int):
    """Eager torch's step on ``bench``: forward, loss, backward, ``torch.optim.Adam`` (gradients to None first);
    and a function that gives the MiB of its state (weights, buffers, Adam's moments once a step has made them)."""
    import torch

    torch.set_num_threads(threads)
    module = copy.deepcopy(bench.module).train()
    inputs = [torch.from_numpy(v) for v in bench.inputs.values()]
    target = torch.from_numpy(bench.target)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)

    def step():
        torch_loss(module(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()  # the gradients are the step's memory: freed after it, as bridge's are

    def state_mib() -> float:
        slots = [value for slot in optimizer.state.values() for value in slot.values() if torch.is_tensor(value)]
        return sum(value.nbytes for value in [*module.state_dict().values(), *slots]) / 2**20

    return step, state_mib


def bridge_step(backend: str, graph: Path, inputs: dict[str, np.ndarray], target: np.ndarray, threads: int):
    """bridge's step on the saved training ``graph`` (its state beside it) in ``backend``, and a function that
    gives the MiB of that state."""
    state = dict(np.load(str(graph) + ".state.npz"))
    state_mib = sum(value.nbytes for value in state.values()) / 2**20
    if backend in COMPILED:
        import onnx

        from bridge.tools.compile import CompiledModel

        module = Path(f"{graph}.{COMPILED[backend]}").read_bytes()
        model = onnx.load(str(graph), load_external_data=False)
        session = CompiledModel(module, backend=COMPILED[backend], graph=model).session(state)
    else:
        from bridge.training import runtime

        with_arena = runtime.session_options

        def without_arena(*args, **kwargs):
            options = with_arena(*args, **kwargs)
            options.enable_cpu_mem_arena = False
            return options

        if backend == "bridge-ort-in-place":  # its pieces run without the arena anyway
            session = runtime.TrainingSession(graph, state, threads=threads, gradients=False, in_place=True)
        else:
            if backend == "bridge-ort":
                runtime.session_options = without_arena
            session = runtime.TrainingSession(graph, state, threads=threads, gradients=False, swap_buffers=True)
    return (lambda: session.step(inputs, target)), (lambda: state_mib)


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints it as JSON."""
    data = np.load(args.data)
    inputs = {name: data[name] for name in data.files if name != "target"}
    import_runtime(args.backend)
    # the model's builder is seeded: the same weights as the converted graph's; built (its libraries imported)
    # before the footprint's start, from which torch's step copies the module as bridge's session loads its state
    bench = MODELS[args.model]() if args.backend == "torch" else None
    before_session, allocated_before = _status_mib("VmRSS"), _status_mib("RssAnon")
    if bench is not None:
        step, state_mib = torch_step(bench, args.threads)
    else:
        step, state_mib = bridge_step(args.backend, Path(args.graph), inputs, data["target"], args.threads)
    if args.backend == "bridge-ort-arena":  # the arena keeps what the steps used: measure the first steps
        _reset_peak()
        baseline, allocated = _status_mib("VmRSS"), _status_mib("RssAnon")
        for _ in range(ARENA_STEPS - 1):
            step()
        start = time.perf_counter()
        step()
        figures = {"peak_mib": _status_mib("VmHWM") - baseline, "baseline_mib": baseline, "allocated_mib": allocated,
                   "step_s": time.perf_counter() - start}
    else:
        figures = measure_step(step)
    figures["footprint_mib"] = figures["baseline_mib"] + figures["peak_mib"] - before_session
    figures["held_mib"] = figures.pop("allocated_mib") - allocated_before - state_mib()
    print(json.dumps(figures))


def run_child(argv: list[str]) -> dict:
    """``child`` in a fresh process with glibc's mmap threshold fixed; its figures."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *argv], capture_output=True,
                          text=True, env=env, cwd=HERE.parent)
    if done.returncode:
        raise RuntimeError((done.stderr.strip().splitlines() or ["the child failed"])[-1][-300:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare(bench: BenchModel, workdir: Path, memory: str, backends: list[str], notes: list[str]) -> Path:
    """The training graph of ``bench`` with ``memory=``, saved with its state in ``workdir``; for each compiled
    backend, the graph converted for it (``target=``) compiled beside it (a note for each that fails)."""
    import bridge

    source = workdir / f"{bench.name}.onnx"
    if not source.exists():
        bench.export(source)
    options = {} if memory == "default" else {"memory": memory}
    tm = bridge.to_training_onnx(source, loss=bench.loss, optim="adam", optim_options={"lr": LR}, **options)
    graph = workdir / f"{bench.name}.{memory}.train.onnx"
    tm.save(graph)
    np.savez(str(graph) + ".state.npz", **tm.initial_state())
    for backend in backends:
        if backend in COMPILED:
            try:  # the graph converted for that compiler, as a user converts it (same source, same state)
                converted = bridge.to_training_onnx(source, loss=bench.loss, optim="adam", optim_options={"lr": LR},
                                                    target=COMPILED[backend], **options)
                target_graph = workdir / f"{bench.name}.{memory}.{COMPILED[backend]}.train.onnx"
                converted.save(target_graph)
                compiled = bridge.compile(target_graph, backend=COMPILED[backend], gradients=False, in_place=True)
            except Exception as exc:  # noqa: BLE001 - a benchmark reports a failing backend and goes on
                notes.append(f"{bench.name} ({memory}): {backend} skipped: {str(exc).splitlines()[0][:200]}")
                continue
            compiled.save(f"{graph}.{COMPILED[backend]}")
    return graph


def measure_model(name: str, backends: list[str], memory_settings: list[str], threads: int, workdir: Path,
                  notes: list[str], converted: dict[str, Path] | None = None) -> list[dict]:
    """One row per backend (and, for bridge's, per memory setting) of model ``name``. ``converted``: graphs
    already converted per memory setting (state and compiled modules beside them, named as ``prepare`` names
    them), used instead of converting and compiling again."""
    bench = MODELS[name]()
    data = workdir / f"{name}.data.npz"
    np.savez(data, **bench.inputs, target=bench.target)
    common = ["--model", name, "--data", str(data), "--threads", str(threads)]
    rows = []
    if "torch" in backends:
        rows.append({"model": name, "backend": "torch", "memory": "-", **run_child([*common, "--backend", "torch"])})
    for memory in memory_settings:
        wanted = [b for b in backends if b in BRIDGE_BACKENDS]
        if not wanted:
            continue
        graph = (converted or {}).get(memory) or prepare(bench, workdir, memory, wanted, notes)
        for backend in wanted:
            if backend in COMPILED and not Path(f"{graph}.{COMPILED[backend]}").exists():
                continue
            try:
                figures = run_child([*common, "--backend", backend, "--graph", str(graph)])
            except RuntimeError as exc:
                notes.append(f"{name} ({memory}): {backend} failed: {exc}")
                continue
            rows.append({"model": name, "backend": backend, "memory": memory, **figures})
    return rows


def step_peak_mib(row: dict) -> float:
    """The step's peak beyond the state: its own peak above the baseline and what the session holds between
    steps (see the module docstring)."""
    return row["peak_mib"] + row["held_mib"]


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: step memory (its own peak, what the session holds between steps, both together) and
    footprint per model and backend, and the ratios of the last two to eager torch's."""
    torch_rows = {r["model"]: r for r in rows if r["backend"] == "torch"}

    def ratio(row: dict, figure) -> str:
        torch_row = torch_rows.get(row["model"])
        return f"{figure(row) / figure(torch_row):.2f}" if torch_row and figure(torch_row) > 0 else "-"

    lines = ["| model | backend | memory= | peak MiB above baseline | held between steps MiB | peak + held MiB | / torch "
             "| footprint MiB | / torch | baseline RSS MiB | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['memory']} | {r['peak_mib']:.1f} | {r['held_mib']:.1f} | "
                     f"{step_peak_mib(r):.1f} | {ratio(r, step_peak_mib)} | {r['footprint_mib']:.1f} | "
                     f"{ratio(r, lambda row: row['footprint_mib'])} | {r['baseline_mib']:.0f} | {r['step_s']:.3f} |")
    return lines


def measure(models: list[str], backends: list[str], memory_settings: list[str], threads: int,
            converted: dict[str, dict[str, Path]] | None = None) -> tuple[list, list]:
    """Every model's rows, and the notes of what was skipped (for benchmarks/run.py's memory section);
    ``converted``: per model, graphs already converted (see ``measure_model``)."""
    if "bridge-onnx-mlir" in backends and not os.environ.get("ONNX_MLIR_HOME"):
        backends = [b for b in backends if b != "bridge-onnx-mlir"]
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for name in models for row in measure_model(name, backends, memory_settings, threads, Path(tmp), notes,
                                                                (converted or {}).get(name))]
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "small_cnn"], choices=list(MODELS))
    parser.add_argument("--backends", nargs="*", default=["torch", "bridge-ort", "bridge-iree"], choices=list(BACKENDS))
    parser.add_argument("--memory", nargs="*", default=["default"], choices=list(MEMORY_SETTINGS),
                        help="to_training_onnx's memory= settings to convert with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--backend", "--data", "--graph"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    rows, notes = measure(args.models, args.backends, args.memory, args.threads)
    print(json.dumps(rows, indent=1) if args.json else "\n".join(table(rows)))
    for note in notes:
        print(f"- {note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
