"""Hand-built ONNX models (``onnx.helper``), each with an independent torch twin.

Every builder returns a ``Case``: the model, a fixed batch, and the first Adam step of its
twin ``twin(params, inputs)`` written with torch.nn.functional / torch.nn modules, never with
bridge's converters.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from .harness import Case, twin_oracle

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def _model(name: str, nodes, inputs: dict[str, np.ndarray], output: str, output_shape, weights: dict[str, np.ndarray],
           opset: int, constants: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    def info(key, value):
        elem = INT64 if value.dtype == np.int64 else FLOAT
        return helper.make_tensor_value_info(key, elem, list(value.shape))

    initializers = [numpy_helper.from_array(v, k) for k, v in {**weights, **(constants or {})}.items()]
    graph = helper.make_graph(nodes, name, [info(k, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(output, FLOAT, output_shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _case(name, nodes, inputs, output_shape, weights, twin, loss, opset, target=None, constants=None, lr=1e-2,
          rtol=1e-5) -> Case:
    rng = np.random.default_rng(len(name))
    if target is None:
        target = (rng.integers(0, output_shape[-1], output_shape[0]).astype(np.int64) if loss == "ce"
                  else rng.standard_normal(output_shape).astype(np.float32))
    model = _model(name, nodes, inputs, "y", output_shape, weights, opset, constants)
    return Case(name, model, inputs, target, loss, set(weights), twin_oracle(twin, weights, inputs, target, loss, lr),
                lr=lr, rtol=rtol)


def _w(rng, *shape, scale=0.5):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def matmul_add_mlp() -> Case:
    """MatMul + Add + Relu at opset 11: weights consumed by MatMul/Add are trained."""
    rng = np.random.default_rng(0)
    weights = {"W1": _w(rng, 6, 8), "b1": _w(rng, 8), "W2": _w(rng, 8, 3), "b2": _w(rng, 3)}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["a"], name="act"),
        helper.make_node("MatMul", ["a", "W2"], ["z"], name="fc2"),
        helper.make_node("Add", ["z", "b2"], ["y"], name="bias2"),
    ]

    def twin(p, i):
        return torch.relu(i["x"] @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]

    return _case("matmul_add_mlp", nodes, {"x": _w(rng, 4, 6, scale=1)}, [4, 3], weights, twin, "ce", 11)


def gemm_mlp() -> Case:
    """Gemm transB/alpha/beta at opset 22; alpha and beta stay in the graph, not in the weights."""
    rng = np.random.default_rng(1)
    weights = {"W1": _w(rng, 8, 6), "C1": _w(rng, 8), "W2": _w(rng, 8, 3), "C2": _w(rng, 1, 3)}
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "C1"], ["h"], name="gemm1", transB=1, alpha=0.7, beta=1.5),
        helper.make_node("Tanh", ["h"], ["a"], name="act"),
        helper.make_node("Gemm", ["a", "W2", "C2"], ["y"], name="gemm2", beta=0.5),
    ]

    def twin(p, i):
        hidden = torch.tanh(0.7 * i["x"] @ p["W1"].T + 1.5 * p["C1"])
        return hidden @ p["W2"] + 0.5 * p["C2"]

    return _case("gemm_mlp", nodes, {"x": _w(rng, 4, 6, scale=1)}, [4, 3], weights, twin, "mse", 22)


def _onnx_to_torch_gates(w: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Reorder gate blocks of the first dim of ``w`` (ONNX order -> torch order)."""
    return torch.cat([w.chunk(len(order))[k] for k in order])


def lstm_classifier() -> Case:
    """LSTM (forward, trainable initial states, opset 14) -> last hidden state -> Gemm."""
    rng = np.random.default_rng(2)
    seq, batch, features, hidden, classes = 5, 3, 4, 6, 3
    weights = {
        "W": _w(rng, 1, 4 * hidden, features), "R": _w(rng, 1, 4 * hidden, hidden), "B": _w(rng, 1, 8 * hidden),
        "h0": _w(rng, 1, batch, hidden), "c0": _w(rng, 1, batch, hidden),
        "Wc": _w(rng, classes, hidden), "bc": _w(rng, classes),
    }
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["Y", "Y_h"], name="lstm", hidden_size=hidden),
        helper.make_node("Squeeze", ["Y_h", "axis0"], ["h"], name="squeeze"),
        helper.make_node("Gemm", ["h", "Wc", "bc"], ["y"], name="head", transB=1),
    ]
    torch_lstm = torch.nn.LSTM(features, hidden)
    order = [0, 2, 3, 1]  # ONNX i, o, f, c -> torch i, f, g, o

    def twin(p, i):
        params = {
            "weight_ih_l0": _onnx_to_torch_gates(p["W"][0], order), "weight_hh_l0": _onnx_to_torch_gates(p["R"][0], order),
            "bias_ih_l0": _onnx_to_torch_gates(p["B"][0, :4 * hidden], order),
            "bias_hh_l0": _onnx_to_torch_gates(p["B"][0, 4 * hidden:], order),
        }
        _, (h, _) = torch.func.functional_call(torch_lstm, params, (i["x"], (p["h0"], p["c0"])))
        return h[0] @ p["Wc"].T + p["bc"]

    return _case("lstm", nodes, {"x": _w(rng, seq, batch, features, scale=1)}, [batch, classes], weights, twin, "ce", 14,
                 constants={"axis0": np.array([0], np.int64)})


def bigru_regressor() -> Case:
    """Bidirectional GRU, batch-first layout, linear_before_reset=1 (torch's GRU), opset 14."""
    rng = np.random.default_rng(3)
    seq, batch, features, hidden = 4, 2, 3, 5
    weights = {"W": _w(rng, 2, 3 * hidden, features), "R": _w(rng, 2, 3 * hidden, hidden), "B": _w(rng, 2, 6 * hidden),
               "Wo": _w(rng, seq * 2 * hidden, 2)}
    nodes = [
        helper.make_node("GRU", ["x", "W", "R", "B"], ["Y"], name="gru", hidden_size=hidden, direction="bidirectional",
                         layout=1, linear_before_reset=1),
        helper.make_node("Reshape", ["Y", "flat"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "Wo"], ["y"], name="head"),
    ]
    torch_gru = torch.nn.GRU(features, hidden, batch_first=True, bidirectional=True)
    order = [1, 0, 2]  # ONNX z, r, h -> torch r, z, n

    def twin(p, i):
        params = {}
        for d, suffix in enumerate(("", "_reverse")):
            params[f"weight_ih_l0{suffix}"] = _onnx_to_torch_gates(p["W"][d], order)
            params[f"weight_hh_l0{suffix}"] = _onnx_to_torch_gates(p["R"][d], order)
            params[f"bias_ih_l0{suffix}"] = _onnx_to_torch_gates(p["B"][d, :3 * hidden], order)
            params[f"bias_hh_l0{suffix}"] = _onnx_to_torch_gates(p["B"][d, 3 * hidden:], order)
        out, _ = torch.func.functional_call(torch_gru, params, (i["x"],))  # [B, T, 2H]
        # ONNX Y (layout 1) is [B, T, D, H]: the same memory order as torch's [B, T, 2H].
        return out.reshape(batch, -1) @ p["Wo"]

    return _case("bigru", nodes, {"x": _w(rng, batch, seq, features, scale=1)}, [batch, 2], weights, twin, "mse", 14,
                 constants={"flat": np.array([batch, -1], np.int64)})


def layernorm_gelu() -> Case:
    """LayerNormalization + Gelu (tanh approximation) at opset 20, then a MatMul head."""
    rng = np.random.default_rng(4)
    weights = {"W1": _w(rng, 6, 8), "scale": 1 + _w(rng, 8, scale=0.1), "bias": _w(rng, 8, scale=0.1),
               "W2": _w(rng, 8, 4)}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["n"], name="ln", axis=-1, epsilon=1e-5),
        helper.make_node("Gelu", ["n"], ["g"], name="gelu", approximate="tanh"),
        helper.make_node("MatMul", ["g", "W2"], ["y"], name="fc2"),
    ]

    def twin(p, i):
        h = F.layer_norm(i["x"] @ p["W1"], (8,), p["scale"], p["bias"], 1e-5)
        return F.gelu(h, approximate="tanh") @ p["W2"]

    return _case("layernorm_gelu", nodes, {"x": _w(rng, 2, 3, 6, scale=1)}, [2, 3, 4], weights, twin, "mse", 20)


def shape_ops() -> Case:
    """Reshape/Transpose/Concat/Split(num_outputs)/Slice(negative step) at opset 18."""
    rng = np.random.default_rng(5)
    weights = {"W": _w(rng, 4, 6), "E": _w(rng, 2, 3)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),                      # [2, 3, 6]
        helper.make_node("Reshape", ["h", "shape"], ["r"], name="reshape"),              # [2, 3, 2, 3]
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1, 3]),  # [2, 2, 3, 3]
        helper.make_node("Split", ["t"], ["s0", "s1", "s2"], name="split", axis=2, num_outputs=3),  # 3 x [2, 2, 1, 3]
        helper.make_node("Unsqueeze", ["E", "uaxes"], ["E3"], name="unsqueeze"),        # [2, 1, 1, 3]
        helper.make_node("Expand", ["E3", "eshape"], ["E4"], name="expand"),            # [2, 2, 1, 3]
        helper.make_node("Concat", ["s2", "s0", "E4"], ["c"], name="concat", axis=2),  # [2, 2, 3, 3]
        helper.make_node("Slice", ["c", "starts", "ends", "axes", "steps"], ["sl"], name="slice"),  # reversed last axis
        helper.make_node("Mul", ["sl", "s1"], ["y"], name="mul"),
    ]
    constants = {
        "shape": np.array([0, 3, 2, -1], np.int64), "uaxes": np.array([1, 2], np.int64),
        "eshape": np.array([2, 2, 1, 3], np.int64),
        "starts": np.array([-1], np.int64), "ends": np.array([-100], np.int64), "axes": np.array([3], np.int64),
        "steps": np.array([-1], np.int64),
    }

    def twin(p, i):
        h = (i["x"] @ p["W"]).reshape(2, 3, 2, 3).permute(0, 2, 1, 3)
        s0, s1, s2 = h.split(1, dim=2)
        e = p["E"][:, None, None, :].expand(2, 2, 1, 3)
        c = torch.cat([s2, s0, e], dim=2)
        return torch.flip(c, [3]) * s1

    return _case("shape_ops", nodes, {"x": _w(rng, 2, 3, 4, scale=1)}, [2, 2, 3, 3], weights, twin, "mse", 18,
                 constants=constants)


def embedding_meanpool() -> Case:
    """Text classifier: Gather (embedding) -> ReduceMean over tokens (opset 13, axes attr) -> Gemm."""
    rng = np.random.default_rng(6)
    vocab, dim, classes = 20, 8, 3
    weights = {"emb": _w(rng, vocab, dim), "Wc": _w(rng, classes, dim), "bc": _w(rng, classes)}
    ids = np.array([[1, 4, 4, 7, 19, 0], [3, 3, 2, 11, 4, 8]], np.int64)  # repeated ids: gradients accumulate
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"], name="embedding"),
        helper.make_node("ReduceMean", ["e"], ["m"], name="pool", axes=[1], keepdims=0),
        helper.make_node("Gemm", ["m", "Wc", "bc"], ["y"], name="head", transB=1),
    ]

    def twin(p, i):
        return F.linear(F.embedding(i["ids"], p["emb"]).mean(1), p["Wc"], p["bc"])

    return _case("embedding_meanpool", nodes, {"ids": ids}, [2, classes], weights, twin, "ce", 13)


def conv1d() -> Case:
    """Conv1d, stride 2, asymmetric pads -> Relu -> ReduceMean over time (opset 18, axes input) -> MatMul."""
    rng = np.random.default_rng(7)
    weights = {"W": _w(rng, 4, 3, 3), "B": _w(rng, 4), "Wo": _w(rng, 4, 3)}
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", strides=[2], pads=[1, 2]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("ReduceMean", ["r", "axis2"], ["m"], name="pool", keepdims=0),
        helper.make_node("MatMul", ["m", "Wo"], ["y"], name="head"),
    ]

    def twin(p, i):
        c = F.relu(F.conv1d(F.pad(i["x"], (1, 2)), p["W"], p["B"], stride=2))
        return c.mean(2) @ p["Wo"]

    return _case("conv1d", nodes, {"x": _w(rng, 2, 3, 10, scale=1)}, [2, 3], weights, twin, "ce", 18,
                 constants={"axis2": np.array([2], np.int64)})


def conv3d() -> Case:
    """Conv3d (pads 1, strides 1/2/2) -> GlobalAveragePool -> Flatten -> Gemm, opset 17."""
    rng = np.random.default_rng(8)
    weights = {"W": _w(rng, 3, 2, 3, 3, 3, scale=0.3), "B": _w(rng, 3), "Wo": _w(rng, 2, 3), "bo": _w(rng, 2)}
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", strides=[1, 2, 2], pads=[1] * 6),
        helper.make_node("Tanh", ["c"], ["t"], name="tanh"),
        helper.make_node("GlobalAveragePool", ["t"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "Wo", "bo"], ["y"], name="head", transB=1),
    ]

    def twin(p, i):
        t = torch.tanh(F.conv3d(i["x"], p["W"], p["B"], stride=(1, 2, 2), padding=1))
        return F.linear(t.mean((2, 3, 4)), p["Wo"], p["bo"])

    return _case("conv3d", nodes, {"x": _w(rng, 2, 2, 5, 6, 6, scale=1)}, [2, 2], weights, twin, "mse", 17)


def conv_transpose_decoder() -> Case:
    """ConvTranspose (stride 2, pads 1, output_padding 1) then a grouped one -> Sigmoid image, opset 11."""
    rng = np.random.default_rng(9)
    weights = {"W1": _w(rng, 4, 4, 3, 3, scale=0.3), "B1": _w(rng, 4), "W2": _w(rng, 4, 1, 2, 2, scale=0.5)}
    nodes = [
        helper.make_node("ConvTranspose", ["x", "W1", "B1"], ["u"], name="up1", strides=[2, 2], pads=[1, 1, 1, 1],
                         output_padding=[1, 1]),
        helper.make_node("Relu", ["u"], ["r"], name="relu"),
        helper.make_node("ConvTranspose", ["r", "W2"], ["v"], name="up2", group=2, strides=[1, 1]),
        helper.make_node("Sigmoid", ["v"], ["y"], name="sigmoid"),
    ]

    def twin(p, i):
        u = F.relu(F.conv_transpose2d(i["x"], p["W1"], p["B1"], stride=2, padding=1, output_padding=1))
        return torch.sigmoid(F.conv_transpose2d(u, p["W2"], groups=2))

    return _case("conv_transpose", nodes, {"x": _w(rng, 2, 4, 3, 3, scale=1)}, [2, 2, 7, 7], weights, twin, "mse", 11)


def average_pool_pads() -> Case:
    """Conv -> AveragePool with pads (count_include_pad 0, ceil_mode) and (count_include_pad 1), opset 19."""
    rng = np.random.default_rng(10)
    weights = {"W": _w(rng, 4, 3, 3, 3, scale=0.3), "Wo": _w(rng, 4 * 4 * 4 + 4 * 3 * 3, 3)}
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["c"], ["a"], name="pool_excl", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1, 1, 1, 1], count_include_pad=0, ceil_mode=1),
        helper.make_node("AveragePool", ["c"], ["b"], name="pool_incl", kernel_shape=[3, 3], strides=[2, 2],
                         pads=[0, 0, 1, 1], count_include_pad=1),
        helper.make_node("Flatten", ["a"], ["fa"], name="flat_a"),
        helper.make_node("Flatten", ["b"], ["fb"], name="flat_b"),
        helper.make_node("Concat", ["fa", "fb"], ["f"], name="concat", axis=1),
        helper.make_node("MatMul", ["f", "Wo"], ["y"], name="head"),
    ]

    def twin(p, i):
        c = F.conv2d(i["x"], p["W"], padding=1)
        a = F.avg_pool2d(c, 3, 2, padding=1, ceil_mode=True, count_include_pad=False)
        b = F.avg_pool2d(F.pad(c, (0, 1, 0, 1)), 3, 2)
        return torch.cat([a.flatten(1), b.flatten(1)], 1) @ p["Wo"]

    return _case("average_pool_pads", nodes, {"x": _w(rng, 2, 3, 7, 7, scale=1)}, [2, 3], weights, twin, "ce", 19)


def depthwise_dilated() -> Case:
    """Depthwise Conv, dilation 2, asymmetric pads -> pointwise Conv -> GlobalMaxPool -> Flatten, opset 13."""
    rng = np.random.default_rng(11)
    weights = {"Wd": _w(rng, 4, 1, 3, 3), "Bd": _w(rng, 4), "Wp": _w(rng, 3, 4, 1, 1), "Bp": _w(rng, 3)}
    nodes = [
        helper.make_node("Conv", ["x", "Wd", "Bd"], ["d"], name="depthwise", group=4, dilations=[2, 2],
                         pads=[2, 1, 0, 3]),
        helper.make_node("Relu", ["d"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "Wp", "Bp"], ["c"], name="pointwise"),
        helper.make_node("GlobalMaxPool", ["c"], ["g"], name="gmp"),
        helper.make_node("Flatten", ["g"], ["y"], name="flatten"),
    ]

    def twin(p, i):
        d = F.relu(F.conv2d(F.pad(i["x"], (1, 3, 2, 0)), p["Wd"], p["Bd"], dilation=2, groups=4))
        return F.conv2d(d, p["Wp"], p["Bp"]).amax((2, 3))

    return _case("depthwise_dilated", nodes, {"x": _w(rng, 2, 4, 8, 9, scale=1)}, [2, 3], weights, twin, "ce", 13)


def odd_sizes_floor() -> Case:
    """Odd spatial sizes that floor: Conv k3 s2 on 9x11, MaxPool k2 s2 (floor) -> Flatten -> Gemm, opset 12."""
    rng = np.random.default_rng(12)
    weights = {"W": _w(rng, 3, 2, 3, 3, scale=0.4), "B": _w(rng, 3), "Wo": _w(rng, 2, 3 * 2 * 2), "bo": _w(rng, 2)}
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("MaxPool", ["c"], ["m"], name="maxpool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["m"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "Wo", "bo"], ["y"], name="head", transB=1),
    ]

    def twin(p, i):
        m = F.max_pool2d(F.conv2d(i["x"], p["W"], p["B"], stride=2), 2, 2)
        return F.linear(m.flatten(1), p["Wo"], p["bo"])

    return _case("odd_sizes_floor", nodes, {"x": _w(rng, 2, 2, 9, 11, scale=1)}, [2, 2], weights, twin, "ce", 12)


def resize_upsampling() -> Case:
    """Conv -> Resize x2 nearest (scales) and bilinear half-pixel (sizes) -> Add -> Conv, opset 13."""
    rng = np.random.default_rng(13)
    weights = {"W1": _w(rng, 3, 2, 3, 3, scale=0.4), "W2": _w(rng, 1, 3, 3, 3, scale=0.4)}
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c", "", "scales"], ["n"], name="nearest", mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("Resize", ["c", "", "", "sizes"], ["l"], name="bilinear", mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Add", ["n", "l"], ["s"], name="add"),
        helper.make_node("Conv", ["s", "W2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    constants = {"scales": np.array([1, 1, 2, 2], np.float32), "sizes": np.array([2, 3, 10, 10], np.int64)}

    def twin(p, i):
        c = F.conv2d(i["x"], p["W1"], padding=1)
        s = F.interpolate(c, scale_factor=2, mode="nearest") + F.interpolate(c, size=(10, 10), mode="bilinear")
        return F.conv2d(s, p["W2"], padding=1)

    return _case("resize_upsampling", nodes, {"x": _w(rng, 2, 2, 5, 5, scale=1)}, [2, 1, 10, 10], weights, twin,
                 "mse", 13, constants=constants)


CASES = [matmul_add_mlp, gemm_mlp, lstm_classifier, bigru_regressor, layernorm_gelu, shape_ops, embedding_meanpool,
         conv1d, conv3d, conv_transpose_decoder, average_pool_pads, depthwise_dilated, odd_sizes_floor,
         resize_upsampling]
