"""Where a compiled IREE step's time goes: IREE's own dispatch profile, by dispatch kind and by dispatch.

    python benchmarks/profile_iree.py resnet18                          # export, convert (target iree), compile, profile
    python benchmarks/profile_iree.py resnet18 --graph g.onnx           # a saved training graph (<graph>.state.npz beside it)
    python benchmarks/profile_iree.py resnet18 --flags=--iree-opt-data-tiling   # further iree-compile flags

The model is one of benchmarks/models.py (loss ``ce``, Adam), converted with ``target="iree"`` and compiled
as benchmarks/run.py compiles it (``bridge.compile``, no ``grad_*`` outputs). One step's feed is written as
``.npy`` files and ``iree-benchmark-module`` runs ``--steps`` steps at ``--threads`` worker threads with IREE's
HAL profiling of host execution (``--device_profiling_mode=host-execution``: each dispatch's time on each
workgroup tile); ``iree-profile dispatch`` sums it per dispatch function. The tables give the tile time per
step by dispatch kind (the name IREE gives each dispatch: ``matmul``, ``elementwise``, ``transpose``,
``slow_memcpy`` for copies such as slices, concats and pads, ``_encoding`` for data tiling's relayouts) and
the dispatches with the most time. Tile time is wall time on the worker threads: on a loaded machine it
counts the waits for a core, so read shares; the CPU time per step that iree-benchmark-module prints is the
figure to compare with other backends.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this checkout's bridge, not an installed one
from models import MODELS  # noqa: E402
from run import LR  # noqa: E402


def tool(name: str) -> str:
    """An IREE command-line tool installed beside this Python (the iree-base-runtime package's), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: pip install iree-base-runtime")
    return found


def write_feed(model: onnx.ModelProto, module: bytes, state: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
               target: np.ndarray, workdir: Path) -> list[str]:
    """iree-benchmark-module's ``--function`` and ``--input`` flags for one step's feed, its arrays saved in
    ``workdir`` (each shaped as the graph declares it: the session feeds a scalar as one element)."""
    import iree.runtime as rt

    from bridge.training.runtime_iree import IreeTrainingSession, _entry_function

    feeds: list[dict[str, np.ndarray]] = []

    class FeedOnly(IreeTrainingSession):
        def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # the step's feed, not run
            feeds.append(feed)
            return {}

    session = FeedOnly(module, state, on_nonfinite="ignore")
    session.step(inputs, target)
    declared = {value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim] for value in model.graph.input}
    vm_module = rt.VmModule.copy_buffer(rt.Config("local-task").vm_instance, module)
    flags = [f"--function={_entry_function(vm_module)}"]
    for index, name in enumerate(session.input_names):
        array = np.ascontiguousarray(feeds[0][name])
        shape = declared.get(name, [])
        if all(shape) and int(np.prod(shape)) == array.size:
            array = array.reshape(shape)
        path = workdir / f"input{index}.npy"
        np.save(path, array)
        flags.append(f"--input=@{path}")
    return flags


def kind(dispatch: str) -> str:
    """The dispatch's kind: its IREE name without the function, number, shape and element types."""
    name = dispatch.split("$async_", 1)[-1]
    name = re.sub(r"^dispatch_\d+_", "", name)
    name = re.sub(r"^_encoding_\d+_.*", "_encoding", name)
    return re.sub(r"_\d.*$", "", name)


def profile(module: Path, flags: list[str], threads: int, steps: int, workdir: Path) -> tuple[list[dict], str]:
    """iree-profile's dispatch groups of ``steps`` profiled steps, and iree-benchmark-module's timing line."""
    bundle = workdir / "step.ireeprof"
    flagfile = workdir / "flags.txt"
    flagfile.write_text("\n".join(flags) + "\n")
    run = subprocess.run([tool("iree-benchmark-module"), f"--module={module}", f"--flagfile={flagfile}",
                          "--device=local-task", f"--task_topology_max_group_count={threads}",
                          f"--benchmark_min_time={steps}x", "--benchmark_repetitions=1",
                          "--device_profiling_mode=host-execution", f"--device_profiling_output={bundle}"],
                         capture_output=True, text=True, check=False)
    if run.returncode:
        raise SystemExit(f"iree-benchmark-module failed: {(run.stderr or run.stdout).strip()[-2000:]}")
    timing = next((line for line in run.stdout.splitlines() if line.startswith("BM_")), "")
    report = subprocess.run([tool("iree-profile"), "dispatch", "--format=jsonl", str(bundle)],
                            capture_output=True, text=True, check=True).stdout
    groups = [json.loads(line) for line in report.splitlines() if '"host_dispatch_group"' in line]
    return groups, timing


def tables(groups: list[dict], top: int) -> str:
    """Tile time per step by kind and per dispatch, largest first, with the share of the step."""
    steps = next(group["count"] for group in groups if "$async_dispatch_0_" in group["key"])  # runs once a step
    whole = sum(group["total_tile_duration_sum_ns"] for group in groups) or 1
    by_kind: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for group in groups:
        by_kind[kind(group["key"])] += group["total_tile_duration_sum_ns"]
        calls[kind(group["key"])] += group["count"]
    lines = [f"tile time {whole / steps / 1e6:.1f} ms per step, {sum(calls.values()) // steps} dispatches per step",
             f"\nby kind{'':33} {'ms/step':>9} {'share':>7} {'calls':>6}"]
    for name, ns in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:40} {ns / steps / 1e6:9.2f} {100 * ns / whole:6.1f}% {calls[name] // steps:6}")
    lines.append(f"\ndispatches{'':70} {'ms/step':>9} {'share':>7} {'calls':>6}")
    for group in sorted(groups, key=lambda g: -g["total_tile_duration_sum_ns"])[:top]:
        ns = group["total_tile_duration_sum_ns"]
        lines.append(f"{group['key'].split('$async_', 1)[-1][:80]:80} {ns / steps / 1e6:9.2f} {100 * ns / whole:6.1f}% "
                     f"{group['count'] // steps:6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--graph", type=Path, help="a saved training graph of this model (its state beside it, "
                                                   "<graph>.state.npz); skips export and conversion")
    parser.add_argument("--flags", action="append", default=[], help="a further iree-compile flag (repeatable)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    import bridge

    bench = MODELS[args.model]()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.graph:
            model = onnx.load(str(args.graph))
            state = dict(np.load(str(args.graph) + ".state.npz"))
        else:
            tm = bridge.to_training_onnx(str(bench.export(workdir / f"{args.model}.onnx")), loss="ce", optim="adam",
                                         optim_options={"lr": LR}, target="iree")
            model, state = tm.model, tm.initial_state()
        compiled = bridge.compile(model, backend="iree", gradients=False, extra_args=tuple(args.flags))
        module = compiled.save(workdir / "step.vmfb")
        flags = write_feed(model, compiled.vmfb, state, bench.inputs, bench.target, workdir)
        groups, timing = profile(module, flags, args.threads, args.steps, workdir)
    print(f"{args.model}: IREE compile {compiled.seconds:.1f} s, {args.threads} worker threads, {args.steps} steps profiled")
    print(f"iree-benchmark-module: {timing}")
    print(tables(groups, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
