"""IREE 3.13 splits an elementwise update with three outputs into three dispatches when its input comes from a MatMul.

    python tests/repros/iree_adam_after_matmul.py [out.onnx]

builds bridge's Adam update of one [512, 512, 3, 3] weight (resnet18's layer4 convs), node for node as bridge
emits it (``m' = m + (g - m) * 0.1``, ``v' = v * 0.999 + g * 0.001 * g``, ``p' = p + step * m' / (sqrt(v') +
eps)``), in three graphs: ``input``, the gradient ``g`` a graph input; ``matmul``, ``g`` computed as
``Reshape(MatMul(a [512, 32], b [32, 4608]))``, the weight gradient's im2col product as the IREE target's step
computes it; ``matmul only``, that product alone. Each is compiled with IREE (bridge.compile's flags, llvm-cpu,
host CPU) with its executable sources dumped; the script prints each graph's dispatches and its CPU time (the
least of 20 calls, one worker thread, inputs already in IREE buffers) beside onnxruntime's at one thread.

``input`` is one elementwise dispatch: it reads ``g, m, v, p`` once and writes ``m', v', p'``. After the MatMul
the update becomes three dispatches, one per output: ``m'`` (reading the product and ``m``), ``v'`` (the product
again and ``v``) and ``p'`` (reading ``p`` and the ``m'`` and ``v'`` just written): ten passes over weight-sized
buffers instead of seven, so the update costs ``matmul - matmul only`` instead of ``input``. In bridge's
resnet18 step (target ``iree``) every conv weight's update is split this way. ``out.onnx``: the ``matmul``
graph is written.
"""
from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WEIGHT = [512, 512, 3, 3]
ROWS, INNER = 512, 32  # the product [ROWS, INNER] @ [INNER, 4608] holds the weight's 2,359,296 values


def build(producer: str) -> onnx.ModelProto:
    """The Adam update of one ``WEIGHT``, its gradient a graph input (``input``) or a reshaped MatMul (``matmul``);
    ``matmul only``: the reshaped MatMul alone."""
    size = int(np.prod(WEIGHT))
    floats = [helper.make_tensor_value_info(name, TensorProto.FLOAT, WEIGHT) for name in ("m", "v", "p")]
    scalars = [helper.make_tensor_value_info(name, TensorProto.FLOAT, []) for name in ("step", "eps")]
    constants = [helper.make_tensor(name, TensorProto.FLOAT, [], [value])
                 for name, value in (("one_minus_beta1", 0.1), ("beta2", 0.999), ("one_minus_beta2", 0.001))]
    nodes = []
    if producer.startswith("matmul"):
        grads = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [ROWS, INNER]),
                 helper.make_tensor_value_info("b", TensorProto.FLOAT, [INNER, size // ROWS])]
        constants.append(helper.make_tensor("weight_shape", TensorProto.INT64, [4], WEIGHT))
        nodes += [helper.make_node("MatMul", ["a", "b"], ["product"]),
                  helper.make_node("Reshape", ["product", "weight_shape"], ["g"])]
    else:
        grads = [helper.make_tensor_value_info("g", TensorProto.FLOAT, WEIGHT)]
    if producer == "matmul only":
        graph = helper.make_graph(nodes, "matmul_only", grads, [helper.make_tensor_value_info("g", TensorProto.FLOAT, WEIGHT)],
                                  constants[-1:])  # the shape
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    nodes += [
        helper.make_node("Sub", ["g", "m"], ["g_minus_m"]),
        helper.make_node("Mul", ["g_minus_m", "one_minus_beta1"], ["m_step"]),
        helper.make_node("Add", ["m", "m_step"], ["m_new"]),
        helper.make_node("Mul", ["v", "beta2"], ["v_decayed"]),
        helper.make_node("Mul", ["g", "one_minus_beta2"], ["g_scaled"]),
        helper.make_node("Mul", ["g_scaled", "g"], ["g_squared"]),
        helper.make_node("Add", ["v_decayed", "g_squared"], ["v_new"]),
        helper.make_node("Mul", ["step", "m_new"], ["numerator"]),
        helper.make_node("Sqrt", ["v_new"], ["root"]),
        helper.make_node("Add", ["root", "eps"], ["denominator"]),
        helper.make_node("Div", ["numerator", "denominator"], ["delta"]),
        helper.make_node("Add", ["p", "delta"], ["p_new"]),
    ]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, WEIGHT) for name in ("m_new", "v_new", "p_new")]
    graph = helper.make_graph(nodes, f"adam_after_{producer}", grads + floats + scalars, outputs, constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def feed(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {}
    for value in model.graph.input:
        shape = [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        values[value.name] = rng.standard_normal(shape).astype(np.float32)
    if "v" in values:
        values["v"] = np.abs(values["v"])
        values["step"], values["eps"] = np.array(-1e-3, np.float32), np.array(1e-8, np.float32)
    return values


def dispatches(directory: Path) -> list[str]:
    """The dispatch names of the executable sources IREE dumped into ``directory``."""
    names = []
    for path in sorted(directory.glob("*.mlir")):
        text = path.read_text()
        names += sorted({line.split("@", 1)[1].split(" ", 1)[0].strip('"') for line in text.splitlines()
                         if "hal.executable.export public @" in line})
    return [name.split("$async_", 1)[-1] for name in names]


def best_ms(run, repeats: int = 20) -> float:
    """Milliseconds of this process's CPU time for one run, the least of ``repeats``: on a loaded machine wall
    time counts the waits for a core."""
    run()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def main() -> None:
    import iree.compiler.tools as iree_tools
    import iree.runtime
    import onnxruntime as ort

    from bridge.tools.compile import _IREE_FLAGS, to_mlir
    from bridge.training.runtime_iree import IreeTrainingSession

    iree.runtime.flags.parse_flags("--task_topology_max_group_count=1")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for producer in ("input", "matmul", "matmul only"):
        model = build(producer)
        onnx.checker.check_model(model, full_check=True)
        if producer == "matmul" and len(sys.argv) > 1:
            onnx.save(model, sys.argv[1])
        values = feed(model)
        with tempfile.TemporaryDirectory() as tmp:
            vmfb = iree_tools.compile_str(to_mlir(model), input_type="onnx", target_backends=["llvm-cpu"],
                                          extra_args=[*_IREE_FLAGS, "--iree-llvmcpu-target-cpu=host",
                                                      f"--iree-hal-dump-executable-sources-to={tmp}"])
            names = dispatches(Path(tmp))
        session = IreeTrainingSession(vmfb, {})
        on_device = [iree.runtime.asdevicearray(session._config.device, values[name]) for name in session.input_names]
        ort_session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        want = dict(zip([o.name for o in model.graph.output], ort_session.run(None, values), strict=True))
        got = session._run(values)
        error = max(float(np.max(np.abs(got[name] - want[name]))) for name in want)
        iree_ms = best_ms(functools.partial(session._function, *on_device))
        ort_ms = best_ms(functools.partial(ort_session.run, None, values))
        print(f"{producer}: {len(names)} dispatches {names}")
        print(f"  IREE {iree_ms:.1f} ms CPU, onnxruntime {ort_ms:.1f} ms CPU (one thread); largest difference {error:.1e}")


if __name__ == "__main__":
    main()
