"""A detection-style head (issue 12): conv features -> per-anchor scores and boxes -> TopK of the
scores -> GatherND of the chosen boxes -> refined by their confidence -> ScatterND back into the
box map. It converts, checks clean for onnx-mlir, and trains like the same function in torch."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, random_batches, torch_steps
from onnx import TensorProto, helper, numpy_helper

import bridge

BATCH, CHANNELS, SIDE, FEATURES, K = 2, 3, 6, 4, 5
ANCHORS = SIDE * SIDE
LR = 0.1


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(12)
    shapes = {"W1": (FEATURES, CHANNELS, 3, 3), "B1": (FEATURES,), "Ws": (1, FEATURES, 1, 1),
              "Wb": (4, FEATURES, 1, 1), "Bb": (4,)}
    return {name: (rng.standard_normal(shape) * 0.5).astype(np.float32) for name, shape in shapes.items()}


def _model():
    ints = {"score_shape": [BATCH, ANCHORS], "box_shape": [BATCH, 4, ANCHORS], "k": [K], "axis2": [2],
            "batch_ids": np.repeat(np.arange(BATCH), K).reshape(BATCH, K, 1)}
    constants = [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in ints.items()]
    weights = [numpy_helper.from_array(v, k) for k, v in _weights().items()]
    node = helper.make_node
    nodes = [
        node("Conv", ["image", "W1", "B1"], ["f"], name="conv", pads=[1, 1, 1, 1]),
        node("Relu", ["f"], ["r"], name="relu"),
        node("Conv", ["r", "Ws"], ["s"], name="score_conv"),
        node("Reshape", ["s", "score_shape"], ["scores"], name="scores"),
        node("Conv", ["r", "Wb", "Bb"], ["bmap"], name="box_conv"),
        node("Reshape", ["bmap", "box_shape"], ["bflat"], name="box_flat"),
        node("Transpose", ["bflat"], ["boxes"], name="boxes", perm=[0, 2, 1]),
        node("TopK", ["scores", "k"], ["top", "top_index"], name="topk", axis=1),
        node("Unsqueeze", ["top_index", "axis2"], ["index"], name="index"),
        node("GatherND", ["boxes", "index"], ["picked"], name="gather", batch_dims=1),
        node("Sigmoid", ["top"], ["confidence"], name="confidence"),
        node("Unsqueeze", ["confidence", "axis2"], ["weight"], name="weight"),
        node("Mul", ["picked", "weight"], ["refined"], name="refine"),
        node("Concat", ["batch_ids", "index"], ["positions"], name="positions", axis=2),
        node("ScatterND", ["boxes", "positions", "refined"], ["out"], name="scatter"),
    ]
    graph = helper.make_graph(nodes, "detection_head",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, [BATCH, CHANNELS, SIDE, SIDE])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [BATCH, ANCHORS, 4])],
                              constants + weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _torch_head(w: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    features = F.relu(F.conv2d(inputs["image"], w["W1"], w["B1"], padding=1))
    scores = F.conv2d(features, w["Ws"]).reshape(BATCH, ANCHORS)
    boxes = F.conv2d(features, w["Wb"], w["Bb"]).reshape(BATCH, 4, ANCHORS).transpose(1, 2)
    top, index = scores.topk(K, dim=1)
    refined = boxes[torch.arange(BATCH)[:, None], index] * torch.sigmoid(top)[..., None]
    out = boxes.clone()
    out[torch.arange(BATCH)[:, None], index] = refined
    return out


def test_detection_head_trains_like_torch():
    tm = bridge.to_training_onnx(_model(), loss="mse", optim="sgd", optim_options={"lr": LR})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    assert {"TopK"} <= {n.op_type for n in tm.model.graph.node}
    batches = random_batches(tm, 3)
    got = bridge_steps(tm, batches)
    want = torch_steps(_torch_head, _weights(), F.mse_loss, torch.optim.SGD, {"lr": LR}, batches)
    assert_steps_match(got, want)
