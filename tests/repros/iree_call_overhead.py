"""The fixed cost of one call into an IREE module from Python, against one onnxruntime run.

    python tests/repros/iree_call_overhead.py

builds graphs that do almost nothing (``ARRAYS`` small float32 arrays in, each plus one out: 1 array, and 20
as a small model's training step passes its weights and optimizer state), compiles each as bridge.compile does
(bridge's flags, llvm-cpu, host CPU) and times one call with its results brought to host arrays, at 2 worker
threads, on IREE's ``local-task`` device (what bridge's session uses) and its ``local-sync`` one (no workers):
through IREE's Python ``FunctionInvoker``, and as bridge's session calls it (``_DirectCall``: IREE's argument
packer and the VM's invoke, each result mapped by its buffer view); against ``InferenceSession.run`` of the
same graph at 2 intra-op threads. Each figure is the median of ``REPEATS`` calls, the two IREE calls taking turns.

A call into IREE costs several times an onnxruntime run, and more per array; ``FunctionInvoker`` decodes each
result in Python, which bridge's session skips. On a model whose whole step takes well under a millisecond
(benchmarks/models.py's mlp) that fixed cost is a large part of IREE's step; with ``in_place=True`` a step is
two calls (``iree_in_place_read_after_write.py``).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ARRAYS = (1, 20)
SIZE = 256
REPEATS = 2000


def build(count: int) -> onnx.ModelProto:
    """``y_i = x_i + 1`` for ``count`` arrays of ``SIZE`` float32 values."""
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [SIZE]) for i in range(count)]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [SIZE]) for i in range(count)]
    nodes = [helper.make_node("Add", [f"x{i}", "one"], [f"y{i}"]) for i in range(count)]
    graph = helper.make_graph(nodes, "almost_nothing", inputs, outputs,
                              [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def median_us(*calls) -> list[float]:
    """The median time of each of ``calls`` over ``REPEATS`` rounds, the calls taking turns, in microseconds."""
    for _ in range(REPEATS // 10):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(REPEATS):
        for call, spent in zip(calls, times, strict=True):
            start = time.perf_counter()
            call()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e6 for spent in times]


def ort_us(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> float:
    """One ``InferenceSession.run`` of ``model`` at 2 intra-op threads, in microseconds."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return median_us(lambda: session.run(None, feed))[0]


def iree_us(vmfb: bytes, driver: str, arrays: list[np.ndarray]) -> tuple[float, float]:
    """One call of the module on ``driver``, its results as host arrays, in microseconds: through
    ``FunctionInvoker``, and as bridge's session calls it."""
    import iree.runtime as rt

    from bridge.training.runtime_iree import _DirectCall

    config = rt.Config(driver)
    vm_module = rt.VmModule.copy_buffer(config.vm_instance, vmfb)
    invoker = rt.load_vm_module(vm_module, config).almost_nothing
    direct, function = _DirectCall(rt, vm_module, config), vm_module.lookup_function("almost_nothing")

    def public() -> list[np.ndarray]:
        results = invoker(*arrays)
        return [r.to_host() for r in (results if isinstance(results, tuple) else (results,))]

    def bridges() -> list[np.ndarray]:
        return [direct.to_host(view) for view in direct(function, arrays, len(arrays))]

    for call in (public, bridges):
        assert all(np.array_equal(got, x + 1) for got, x in zip(call(), arrays, strict=True))
    first, second = median_us(public, bridges)
    return first, second


def main() -> None:
    import iree.compiler.tools as iree_tools
    import iree.runtime as rt

    from bridge.tools.compile import _IREE_FLAGS, to_mlir

    rt.flags.parse_flags("--task_topology_max_group_count=2")
    for count in ARRAYS:
        model = build(count)
        onnx.checker.check_model(model, full_check=True)
        feed = {f"x{i}": np.full(SIZE, i, np.float32) for i in range(count)}
        vmfb = iree_tools.compile_str(to_mlir(model, ()), input_type="onnx", target_backends=["llvm-cpu"],
                                      extra_args=[*_IREE_FLAGS, "--iree-llvmcpu-target-cpu=host"])
        ort = ort_us(model, feed)
        for driver in ("local-task", "local-sync"):
            public, bridges = iree_us(vmfb, driver, list(feed.values()))
            print(f"{count:2d} arrays, IREE {driver}: {public:6.1f} us a call (FunctionInvoker), {bridges:6.1f} us "
                  f"(bridge's session); onnxruntime: {ort:5.1f} us a run")

if __name__ == "__main__":
    main()
