"""Small hand-built ONNX models shared by tests (each returns the model and its weights)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def matmul_add_mlp() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """MatMul + Add + Relu + MatMul, a hand-built ONNX MLP (opset 17), and its weights."""
    rng = np.random.default_rng(1)
    weights = {
        "W1": rng.standard_normal((6, 8)).astype(np.float32),
        "b1": rng.standard_normal(8).astype(np.float32),
        "W2": rng.standard_normal((8, 3)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "W2"], ["y"], name="fc2"),
    ]
    return _float_model("matmul_add_mlp", nodes, ("x", [4, 6]), ("y", [4, 3]), weights, 17), weights


def gemm_mlp() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Gemm with transA=1, transB=1, alpha != 1, beta != 1, and a weight shared by two layers."""
    rng = np.random.default_rng(2)
    weights = {
        "W": rng.standard_normal((5, 5)).astype(np.float32),
        "C": rng.standard_normal(5).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["xt", "W", "C"], ["h"], name="gemm1", transA=1, transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Sigmoid", ["h"], ["a"], name="act"),
        helper.make_node("Gemm", ["a", "W"], ["y"], name="gemm2", alpha=1.5),
    ]
    return _float_model("gemm_mlp", nodes, ("xt", [5, 3]), ("y", [3, 5]), weights, 13), weights


def _float_model(name: str, nodes: list[onnx.NodeProto], x: tuple[str, list[int]], y: tuple[str, list[int]],
                 weights: dict[str, np.ndarray], opset: int) -> onnx.ModelProto:
    """A float32 model of ``nodes`` with one input ``x`` and one output ``y`` (name, shape), ``weights``
    as initializers."""
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(x[0], TensorProto.FLOAT, x[1])],
        [helper.make_tensor_value_info(y[0], TensorProto.FLOAT, y[1])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
