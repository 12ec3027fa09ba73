"""onnx-mlir compile time grows faster than the graph with the number of graph outputs.

    python tests/repros/onnx_mlir_many_outputs.py [out.onnx] [outputs ...] [--packed]

builds a chain of 400 ``Mul``s on a 16-element tensor, ``outputs`` of whose results are graph outputs
(default 1 and 400; ``out.onnx``: the 400-output graph is written), compiles each with
``onnx-mlir --EmitLib -O3`` and prints the compiler's CPU time. The graph's work is the same; only
the outputs differ: 1 output compiles in about 2 s, 400 in 34-41 s, most of it in llc's
"X86 DAG->DAG Instruction Selection" (``llc -time-passes``). onnx-mlir's ``main_graph`` returns its
outputs as one LLVM struct of memref descriptors, built field by field, and its LLVM IR text grows
quadratically with the outputs (``--EmitLLVMIR``: 4.4, 13 and 48 MB at 100, 200 and 400). 400 graph
inputs of the same shape cost nothing alike. ``--packed`` returns the same results flattened and
concatenated into one output: 23 s, as a ``Concat`` of 400 operands is itself slow to compile.
A training graph returns every gradient and every updated state: 290 outputs for resnet18.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CHAIN, SIZE = 400, 16


def build(outputs: int, packed: bool = False) -> onnx.ModelProto:
    """``y_i = y_{i-1} * b_i`` for 400 steps; ``outputs`` of the ``y_i`` (evenly spaced) are returned,
    each as a graph output or, ``packed``, all in one flat output."""
    nodes = [helper.make_node("Mul", ["x" if i == 0 else f"y{i - 1}", f"b{i}"], [f"y{i}"]) for i in range(CHAIN)]
    returned = [f"y{i}" for i in range(CHAIN - 1, -1, -max(1, CHAIN // outputs))][:outputs]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZE])]
    inputs += [helper.make_tensor_value_info(f"b{i}", TensorProto.FLOAT, []) for i in range(CHAIN)]
    initializers = []
    if packed:
        initializers.append(numpy_helper.from_array(np.array([-1], np.int64), "flat"))
        nodes += [helper.make_node("Reshape", [name, "flat"], [f"{name}/flat"]) for name in returned]
        nodes.append(helper.make_node("Concat", [f"{name}/flat" for name in returned], ["packed"], axis=0))
        graph_outputs = [helper.make_tensor_value_info("packed", TensorProto.FLOAT, [SIZE * len(returned)])]
    else:
        graph_outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [SIZE]) for name in returned]
    graph = helper.make_graph(nodes, f"mul_chain_{outputs}_outputs", inputs, graph_outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def compile_seconds(model: onnx.ModelProto) -> float:
    """CPU seconds (user + system) of ``onnx-mlir --EmitLib -O3`` and the LLVM tools it runs."""
    compiler = Path(os.environ.get("ONNX_MLIR_HOME", "/work/shared/onnx-mlir/install")) / "bin" / "onnx-mlir"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        onnx.save(model, str(path))
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([str(compiler), "--EmitLib", "-O3", str(path)], check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


if __name__ == "__main__":
    arguments = sys.argv[1:]
    for path in [a for a in arguments if a.endswith(".onnx")]:
        onnx.save(build(CHAIN), path)
    packed = "--packed" in arguments
    for count in [int(a) for a in arguments if a.isdigit()] or [1, CHAIN]:
        print(f"{count} outputs{' packed' if packed else ''}: {compile_seconds(build(count, packed)):.1f} s CPU")
