"""onnx-mlir accuracy: ReduceSum over many float32 elements adds them one by one into one float32
accumulator, so its rounding error grows with the element count, several times onnxruntime's at a few
thousand elements.

    python tests/repros/onnx_mlir_reduce_sum_sequential.py [out.onnx]

builds ONE ReduceSum of x [n] (all axes, n = 6480, the element count of the node test
``test_nllloss_NCd1d2d3d4d5_mean_weight_expanded``), writes it, compiles it with ``onnx-mlir --EmitLib
-O3`` and sums positive random values (the terms of a loss) in onnx-mlir, onnxruntime (one thread),
numpy's pairwise sum and a sequential float32 sum (``np.cumsum``'s last element), each against the
float64 sum. onnx-mlir's result is the sequential sum bit for bit, its error several times onnxruntime's
(which sums in blocks) and far above numpy's pairwise sum.
In that node test the loss is such a sum and its weight gradient divides by it: onnx-mlir's loss and
``grad_weight`` are off onnxruntime's by more than the op rows' tolerance (4 times onnxruntime's own
float32 error). Not a wrong result, but a less accurate one; bridge does not change the ReduceSum of
the source model.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

if not __package__:  # run as a script: tests/ on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COUNT = 6480


def build(count: int = COUNT) -> onnx.ModelProto:
    """``y = ReduceSum(x)``, x [count] float32, keepdims 0."""
    node = helper.make_node("ReduceSum", ["x"], ["y"], name="sum", keepdims=0)
    graph = helper.make_graph([node], "reduce_sum_sequential", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [count])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def relative_errors(count: int = COUNT, seed: int = 0) -> dict[str, float]:
    """Each summation's error relative to the float64 sum of the same float32 values, and whether
    onnx-mlir's result equals the sequential float32 sum bit for bit."""
    import onnxruntime

    from bridge.training.runtime_onnx_mlir import OnnxMlirGraph
    from repros.onnx_mlir_defects import compile_as_is

    model = build(count)
    with tempfile.TemporaryDirectory() as folder:
        compiled = OnnxMlirGraph(open(compile_as_is(model, folder), "rb").read(), model)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    ort = onnxruntime.InferenceSession(model.SerializeToString(), options)
    x = np.random.default_rng(seed).random(count).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    sums = {"onnx-mlir": float(compiled({"x": x})["y"]), "onnxruntime": float(ort.run(None, {"x": x})[0]),
            "numpy pairwise": float(np.sum(x)), "sequential float32": float(np.cumsum(x)[-1])}
    found = {name: abs(value - exact) / exact for name, value in sums.items()}
    found["onnx-mlir is the sequential sum"] = float(sums["onnx-mlir"] == sums["sequential float32"])
    return found


if __name__ == "__main__":
    if len(sys.argv) > 1:
        onnx.save(build(), sys.argv[1])
    for name, value in relative_errors().items():
        print(f"{name}: {value:.3g}")
