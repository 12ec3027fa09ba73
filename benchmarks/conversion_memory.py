"""Peak memory of converting a 100.7M-parameter MLP (6 x Linear(4096, 4096), 403 MB of float32 weights).

Run: ``python benchmarks/conversion_memory.py [--frozen N] [--json]``. Prints the weights' size, the times
of the conversion and of conversion + save, the peak RSS of the converting process, its RSS after
``import torch, bridge.api`` (what the process holds before converting) and the peak above that as a
multiple of the weights; ``--json``: the same as one JSON object (benchmarks/run.py's "Conversion
memory" table). The model file is written to a temporary folder first (in a child process, so that its
memory does not count).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS, WIDTH = 6, 4096


def write_model(path: Path) -> int:
    """The MLP as ONNX at ``path`` (built with numpy + onnx helpers); returns its weight bytes."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, inits, current = [], [], "x"
    for i in range(LAYERS):
        w = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * (1 / WIDTH) ** 0.5
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"), numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"fc{i}.bias")]
        nodes.append(helper.make_node("Gemm", [current, f"fc{i}.weight", f"fc{i}.bias"], [f"h{i}"], transB=1))
        current = f"h{i}"
        if i < LAYERS - 1:
            nodes.append(helper.make_node("Relu", [current], [f"r{i}"]))
            current = f"r{i}"
    graph = helper.make_graph(nodes, "mlp100m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, ["batch", WIDTH])], inits)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return sum(i.ByteSize() for i in inits)


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def convert(path: Path, frozen: int, as_json: bool) -> None:
    import torch  # noqa: F401 - imported before the baseline is read, as bridge.api imports it

    import bridge
    import bridge.api  # noqa: F401

    imported = rss_mb()
    weights = path.stat().st_size / 2**20
    start = time.perf_counter()
    frozen_names = [f"fc{i}.*" for i in range(frozen)] or None
    tm = bridge.to_training_onnx(path, "mse", "sgd", frozen=frozen_names)
    converted = time.perf_counter() - start
    tm.save(path.with_name("train.onnx"), state_path=path.with_name("train.state.npz"))
    total = time.perf_counter() - start
    peak = peak_mb()
    if as_json:
        print(json.dumps({"weights_mib": weights, "convert_s": converted, "total_s": total, "peak_mib": peak,
                          "import_mib": imported}))
        return
    print(f"weights {weights:.0f} MiB; convert {converted:.1f} s, convert+save {total:.1f} s; peak RSS {peak:.0f} MiB, "
          f"{imported:.0f} MiB after the imports: {(peak - imported) / weights:.2f}x the weights above them")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frozen", type=int, default=0, help="freeze the first N layers")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        convert(Path(args.child), args.frozen, args.json)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mlp100m.onnx"
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                        f"from conversion_memory import write_model; write_model(__import__('pathlib').Path({str(path)!r}))"],
                       check=True)
        subprocess.run([sys.executable, __file__, "--child", str(path), "--frozen", str(args.frozen)]
                       + (["--json"] if args.json else []), check=True)


if __name__ == "__main__":
    main()
