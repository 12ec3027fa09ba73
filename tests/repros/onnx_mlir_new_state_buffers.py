"""onnx-mlir returns every output in a new buffer: a step's updated state is a second copy of the state.

    python tests/repros/onnx_mlir_new_state_buffers.py [out.onnx]

builds the smallest optimizer step: an Adam-like update of one large state (``p``, ``m``, ``v``, 24 MiB each,
the gradient ``g`` an input): ``m' = m + (g - m) * 0.1``, ``v' = v * 0.999 + g * g * 0.001``,
``p' = p - 0.01 * m' / (sqrt(v') + 1e-8)``, outputs ``p', m', v'``. Each runtime steps it in a child process
(glibc's mmap threshold fixed at 64 KiB, as in benchmarks/step_memory.py, so that RSS follows live memory),
fed its previous outputs as a training loop is: one warm-up step, then the peak RSS of one step above the RSS
before it, in units of the state (``p, m, v``), and which of the arrays passed in the warm-up step wrote.
onnx-mlir runs the library compiled with ``--EmitLib -O3``, and with ``--enable-krnl-buffer-reuse`` added;
onnxruntime (CPU arena off) runs the graph with its outputs bound to a second set of state buffers
(``run_with_iobinding``, as bridge's ``swap_buffers`` does), and plainly.

onnx-mlir's entry point (``run_main_graph``) returns a new list of tensors that the library allocated: no
option (``onnx-mlir --help``) or runtime call (``OnnxMlirRuntime.h``, ``OMTensor.h``) writes an output into
a caller's buffer or an input's. Its step peaks at the whole new state beside the old (1x the state above the
baseline) plus the intermediates it keeps; onnxruntime writing into the second set adds only its
intermediates. ``--enable-krnl-buffer-reuse`` leaves the outputs new and takes intermediates' buffers from
the inputs that have one reader: it writes into the caller's ``v``, so bridge does not use it.
``out.onnx``: the graph is written.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
from onnx import TensorProto, helper

if not __package__:  # run as a script: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZE = 6 * 2**20  # floats per state tensor: 24 MiB
STATE = ("p", "m", "v")
MMAP_THRESHOLD = 65536


def build() -> onnx.ModelProto:
    """The Adam-like update of one ``SIZE``-float state: inputs ``p, m, v, g``, outputs ``p', m', v'``."""
    vector = [SIZE]
    constants = [helper.make_tensor(name, TensorProto.FLOAT, [], [value]) for name, value in
                 (("b1", 0.1), ("b2", 0.999), ("c2", 0.001), ("lr", 0.01), ("eps", 1e-8))]
    nodes = [helper.make_node("Sub", ["g", "m"], ["g_minus_m"]),
             helper.make_node("Mul", ["g_minus_m", "b1"], ["m_step"]),
             helper.make_node("Add", ["m", "m_step"], ["m_new"]),
             helper.make_node("Mul", ["v", "b2"], ["v_decayed"]),
             helper.make_node("Mul", ["g", "g"], ["g_squared"]),
             helper.make_node("Mul", ["g_squared", "c2"], ["g_scaled"]),
             helper.make_node("Add", ["v_decayed", "g_scaled"], ["v_new"]),
             helper.make_node("Sqrt", ["v_new"], ["root"]),
             helper.make_node("Add", ["root", "eps"], ["denominator"]),
             helper.make_node("Div", ["m_new", "denominator"], ["ratio"]),
             helper.make_node("Mul", ["ratio", "lr"], ["delta"]),
             helper.make_node("Sub", ["p", "delta"], ["p_new"])]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, vector) for name in (*STATE, "g")]
    outputs = [helper.make_tensor_value_info(f"{name}_new", TensorProto.FLOAT, vector) for name in STATE]
    graph = helper.make_graph(nodes, "adam_like_step", inputs, outputs, constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


CHILD = r"""
import json, sys, numpy as np
runtime, path, lib = sys.argv[1:4]
def mib(key):
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith(key + ":")).split()[1]) / 1024
rng = np.random.default_rng(0)
state = {n: rng.random(SIZE, dtype=np.float32) for n in ("p", "m", "v")}
g = rng.random(SIZE, dtype=np.float32)
if runtime == "onnx-mlir":
    sys.path.append(lib)
    from PyRuntime import OMExecutionSession
    session = OMExecutionSession(path, tag="NONE")
    def step():
        global state
        state = dict(zip(("p", "m", "v"), session.run([state["p"], state["m"], state["v"], g])))
else:
    import onnxruntime as ort
    options = ort.SessionOptions(); options.enable_cpu_mem_arena = False
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    spare = {n: value.copy() for n, value in state.items()}
    def step():
        global state, spare
        if runtime == "onnxruntime":
            state = dict(zip(("p", "m", "v"), session.run(None, {**state, "g": g})))
            return
        binding = session.io_binding()
        for n in ("p", "m", "v"):
            binding.bind_cpu_input(n, state[n]); binding.bind_output(n + "_new", "cpu", 0, np.float32, [SIZE], spare[n].ctypes.data)
        binding.bind_cpu_input("g", g)
        session.run_with_iobinding(binding)
        state, spare = spare, state
passed = {n: (value, value.copy()) for n, value in state.items()}
step()
written = [n for n, (value, before) in passed.items() if not np.array_equal(value, before)]
del passed
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
baseline = mib("VmRSS")
step()
print(json.dumps({"peak_mib": mib("VmHWM") - baseline, "written": written}))
""".replace("SIZE", str(SIZE))


def measure(runtime: str, path: str) -> dict:
    """``runtime`` running ``path`` in a fresh child process: the step's peak RSS above its baseline (MiB,
    ``peak_mib``) and the state inputs the warm-up step wrote into (``written``)."""
    lib = str(Path(os.environ.get("ONNX_MLIR_HOME", "/work/shared/onnx-mlir/install")) / "lib")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    done = subprocess.run([sys.executable, "-c", CHILD, runtime, path, lib], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from repros.onnx_mlir_defects import compile_as_is

    model = build()
    if len(sys.argv) > 1:
        onnx.save(model, sys.argv[1])
    state_mib = len(STATE) * SIZE * 4 / 2**20
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "step.onnx")
        onnx.save(model, source)
        rows = [("onnxruntime, outputs into the second set", "onnxruntime-swap", source),
                ("onnxruntime, new outputs", "onnxruntime", source)]
        for flags in ((), ("--enable-krnl-buffer-reuse",)):
            built = Path(folder) / ("reuse" if flags else "plain")
            built.mkdir()
            rows.append((f"onnx-mlir --EmitLib -O3 {' '.join(flags)}".rstrip(), "onnx-mlir",
                         compile_as_is(model, str(built), flags)))
        print(f"state (p, m, v): {state_mib:.0f} MiB; one step's peak RSS above the baseline:")
        for label, runtime, path in rows:
            figures = measure(runtime, path)
            print(f"  {label}: {figures['peak_mib']:.0f} MiB = {figures['peak_mib'] / state_mib:.2f}x the state; "
                  f"inputs written: {figures['written'] or 'none'}")


if __name__ == "__main__":
    main()
