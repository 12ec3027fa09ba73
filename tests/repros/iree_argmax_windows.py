"""IREE 3.13 defect: the max-pool backward bridge emitted before issue 14 (ArgMax over the
window elements stacked on a new axis) at a real size.

    python tests/repros/iree_argmax_windows.py [out.onnx]

builds that form with onnx.helper for resnet18's max pool at 64x64 (x [8, 64, 32, 32], 3x3
windows, stride 2, pads 1; g [8, 64, 16, 16] the pooled gradient): Pad(-inf) -> 9 strided
Slices -> Unsqueeze + Concat on axis 2 -> ArgMax(axis 2) -> Equal(offset) -> Where(g, 0) ->
``routed`` [8, 64, 9, 16, 16] (each window's gradient at the offset of its first max). It
compiles it with IREE (llvm-cpu, bridge.compile) at the default flags and with the stack limit
raised, and compares ``routed`` with onnxruntime on random data and on data with ties.

Measured (IREE 3.13, x86-64 host): at the default flags ``'func.func' op exceeded stack
allocation limit of 32768 bytes for function. Got 131072 bytes`` (on the ArgMax); with
``--iree-llvmcpu-stack-allocation-limit=1048576`` it compiles and the process dies with a
segmentation fault when the module runs. At batch 2 (``N = 2``) both compile and match
onnxruntime exactly. In resnet18 at 64x64 the raised limit ran, with 11 of 62 gradients 0.3-3.2%
off: consistent with a dispatch whose stack buffer outgrows its worker thread's stack (not
proven further). bridge's max-pool backward now uses no ArgMax (``bridge/pipeline/lowering/pool.py``).
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

N, C, L, K, S, P = 8, 64, 32, 3, 2, 1
O = (L + 2 * P - K) // S + 1


def build() -> onnx.ModelProto:
    ints = lambda name, values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    inits = [ints("pads", [0, 0, P, P, 0, 0, (O - 1) * S + K - L - P, (O - 1) * S + K - L - P]),
             numpy_helper.from_array(np.array(-np.inf, np.float32), "neg_inf"),
             ints("axes", [2, 3]), ints("steps", [S, S]), ints("axis2", [2]),
             ints("offsets", np.arange(K * K).reshape(1, 1, K * K, 1, 1)),
             numpy_helper.from_array(np.array(0, np.float32), "zero")]
    nodes = [helper.make_node("Pad", ["x", "pads", "neg_inf"], ["padded"], name="pad")]
    windows = []
    for i in range(K):
        for j in range(K):
            name = f"w{i}{j}"
            inits += [ints(f"{name}_start", [i, j]), ints(f"{name}_end", [i + (O - 1) * S + 1, j + (O - 1) * S + 1])]
            nodes += [helper.make_node("Slice", ["padded", f"{name}_start", f"{name}_end", "axes", "steps"], [name],
                                       name=f"slice_{name}"),
                      helper.make_node("Unsqueeze", [name, "axis2"], [f"{name}_u"], name=f"unsqueeze_{name}")]
            windows.append(f"{name}_u")
    nodes += [helper.make_node("Concat", windows, ["stacked"], axis=2, name="stack"),
              helper.make_node("ArgMax", ["stacked"], ["first_max"], axis=2, keepdims=1, name="window_argmax"),
              helper.make_node("Equal", ["first_max", "offsets"], ["is_max"], name="is_max"),
              helper.make_node("Unsqueeze", ["g", "axis2"], ["g_u"], name="unsqueeze_g"),
              helper.make_node("Where", ["is_max", "g_u", "zero"], ["routed"], name="route")]
    graph = helper.make_graph(nodes, "argmax_windows",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, C, L, L]),
                               helper.make_tensor_value_info("g", TensorProto.FLOAT, [N, C, O, O])],
                              [helper.make_tensor_value_info("routed", TensorProto.FLOAT, [N, C, K * K, O, O])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def run(extra_args: tuple[str, ...] = ()) -> dict[str, float]:
    """Largest |IREE - onnxruntime| of ``routed`` per input kind (raises bridge.CompileError)."""
    import iree.runtime as rt
    import onnxruntime as ort

    import bridge

    model = build()
    vmfb = bridge.compile(model, extra_args=extra_args).vmfb
    print(f"  compiled ({' '.join(extra_args) or 'default flags'}); running", flush=True)
    config = rt.Config("local-task")
    module = rt.load_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb), config)
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    g = rng.standard_normal((N, C, O, O)).astype(np.float32)
    inputs = {"random": rng.standard_normal((N, C, L, L)).astype(np.float32),
              "ties": np.maximum(rng.integers(-2, 3, (N, C, L, L)), 0).astype(np.float32)}  # ReLU-like
    errors = {}
    for kind, x in inputs.items():
        got = np.asarray(module.argmax_windows(x, g).to_host())
        errors[kind] = float(np.max(np.abs(got - reference.run(None, {"x": x, "g": g})[0])))
    return errors


if __name__ == "__main__":
    import bridge

    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    try:
        print("default flags, max |IREE - onnxruntime|:", run())
    except bridge.CompileError as exc:
        print("default flags:", exc)
    print("stack limit 1 MiB, max |IREE - onnxruntime|:", run(("--iree-llvmcpu-stack-allocation-limit=1048576",)))
