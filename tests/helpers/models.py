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
    graph = helper.make_graph(
        nodes, "matmul_add_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weights


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
    graph = helper.make_graph(
        nodes, "gemm_mlp",
        [helper.make_tensor_value_info("xt", TensorProto.FLOAT, [5, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), weights
