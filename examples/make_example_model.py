"""Build the bundled example: a small classifier MLP (Gemm-ReLU-Gemm) as examples/models/mlp.onnx.

Random weights with a fixed seed; input ``features`` [batch, 8] (symbolic batch), output
``logits`` [batch, 3]. Run: ``python examples/make_example_model.py``.
"""
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = {
        "fc1.weight": (rng.standard_normal((32, 8)) * 0.3).astype(np.float32),
        "fc1.bias": np.zeros(32, np.float32),
        "fc2.weight": (rng.standard_normal((3, 32)) * 0.3).astype(np.float32),
        "fc2.bias": np.zeros(3, np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["features", "fc1.weight", "fc1.bias"], ["hidden"], name="fc1", transB=1),
        helper.make_node("Relu", ["hidden"], ["activated"], name="relu"),
        helper.make_node("Gemm", ["activated", "fc2.weight", "fc2.bias"], ["logits"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "example_mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="bridge-example")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    path = Path(__file__).parent / "models" / "mlp.onnx"
    path.parent.mkdir(exist_ok=True)
    onnx.save(build(), path)
    print(f"wrote {path}")
