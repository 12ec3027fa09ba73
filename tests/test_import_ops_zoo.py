"""Forward of the converters real exports need (RNN family, GatherND, sequences) vs onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers.importer import assert_importer_matches_onnxruntime, import_and_run, run_onnxruntime
from onnx import TensorProto, helper


def _model(nodes, inputs: dict[str, np.ndarray], outputs: list[str], opset: int, initializers=()) -> onnx.ModelProto:
    def info(name, value):
        elem = TensorProto.INT64 if value.dtype == np.int64 else TensorProto.FLOAT
        return helper.make_tensor_value_info(name, elem, list(value.shape))

    graph = helper.make_graph(nodes, "g", [info(k, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run_both(nodes, inputs, outputs, opset, initializers=()):
    model = _model(nodes, inputs, outputs, opset, initializers)
    assert_importer_matches_onnxruntime(model, inputs, rtol=1e-5, atol=1e-5, checked=False, what=str(outputs))


RNN_CASES = [
    ("RNN", {"direction": "reverse", "activations": ["Relu"]}, False),
    ("RNN", {"direction": "bidirectional", "activations": ["Tanh", "Sigmoid"], "layout": 1}, True),
    ("GRU", {"direction": "forward", "linear_before_reset": 0}, True),
    ("GRU", {"direction": "reverse", "linear_before_reset": 1, "clip": 0.5}, False),
    ("GRU", {"direction": "bidirectional", "layout": 1}, True),
    ("LSTM", {"direction": "forward"}, True),
    ("LSTM", {"direction": "reverse", "input_forget": 1}, False),
    ("LSTM", {"direction": "bidirectional", "layout": 1, "activations": ["HardSigmoid", "Tanh", "Softsign"] * 2,
              "activation_alpha": [0.3, 0.3], "activation_beta": [0.4, 0.4]}, True),
    ("LSTM", {"direction": "forward", "clip": 0.7, "activations": ["Sigmoid", "LeakyRelu", "Tanh"],
              "activation_alpha": [0.2]}, True),
]


@pytest.mark.parametrize("op, attrs, with_state", RNN_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RNN_CASES)])
def test_recurrent_ops_match_onnxruntime(op, attrs, with_state):
    rng = np.random.default_rng(0)
    seq, batch, features, hidden = 4, 3, 5, 6
    dirs = 2 if attrs["direction"] == "bidirectional" else 1
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    layout = attrs.get("layout", 0)
    x_shape = (batch, seq, features) if layout else (seq, batch, features)
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    inputs = {
        "x": rng.standard_normal(x_shape).astype(np.float32),
        "W": rng.standard_normal((dirs, gates * hidden, features)).astype(np.float32) * 0.5,
        "R": rng.standard_normal((dirs, gates * hidden, hidden)).astype(np.float32) * 0.5,
        "B": rng.standard_normal((dirs, 2 * gates * hidden)).astype(np.float32) * 0.5,
    }
    names = ["x", "W", "R", "B", ""]
    if with_state:
        inputs["h0"] = rng.standard_normal(state_shape).astype(np.float32)
        names.append("h0")
        if op == "LSTM":
            inputs["c0"] = rng.standard_normal(state_shape).astype(np.float32)
            inputs["P"] = rng.standard_normal((dirs, 3 * hidden)).astype(np.float32) * 0.5
            names += ["c0", "P"]
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, hidden_size=hidden, **attrs)
    got = import_and_run(_model([node], inputs, outputs, 14), inputs, checked=False)
    if layout:  # onnxruntime has no batch-first RNNs: run it on the seq-first problem
        inputs = {k: v.swapaxes(0, 1) if k in ("x", "h0", "c0") else v for k, v in inputs.items()}
        node = helper.make_node(op, names, outputs, hidden_size=hidden, **{**attrs, "layout": 0})
    want = run_onnxruntime(_model([node], inputs, outputs, 14), inputs)
    if layout:  # Y [T, D, B, H] -> [B, T, D, H]; states [D, B, H] -> [B, D, H]
        want = [want[0].transpose(2, 0, 1, 3)] + [w.swapaxes(0, 1) for w in want[1:]]
    for name, w, g in zip(outputs, want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_recurrent_sequence_lens_that_pad_are_rejected():
    from bridge.errors import UnsupportedOpError
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((3, 2, 4)).astype(np.float32),
              "W": rng.standard_normal((1, 2, 4)).astype(np.float32), "R": rng.standard_normal((1, 2, 2)).astype(np.float32)}
    lens = onnx.numpy_helper.from_array(np.array([3, 2], np.int32), "lens")
    node = helper.make_node("RNN", ["x", "W", "R", "", "lens"], ["Y"], name="rnn", hidden_size=2)
    with pytest.raises(UnsupportedOpError, match="rnn.*sequence_lens"):
        import_and_run(_model([node], inputs, ["Y"], 14, [lens]), inputs, checked=False)


@pytest.mark.parametrize("batch_dims, data_shape, index_shape", [
    (0, (3, 4, 5), (2, 2)), (0, (3, 4, 5), (2, 3, 1)), (1, (3, 4, 5), (3, 2, 1)), (2, (2, 3, 4, 5), (2, 3, 1)),
    (1, (3, 4, 5), (3, 2, 2)),
])
def test_gather_nd_matches_onnxruntime(batch_dims, data_shape, index_shape):
    rng = np.random.default_rng(2)
    low = -data_shape[batch_dims] + 1 if batch_dims == 0 else 0
    indices = rng.integers(low, min(data_shape[batch_dims:batch_dims + index_shape[-1]]), index_shape).astype(np.int64)
    node = helper.make_node("GatherND", ["d", "i"], ["y"], batch_dims=batch_dims)
    _run_both([node], {"d": rng.standard_normal(data_shape).astype(np.float32), "i": indices}, ["y"], 13)


def test_sequence_ops_match_onnxruntime():
    rng = np.random.default_rng(3)
    consts = [onnx.numpy_helper.from_array(np.array(v, np.int64), k)
              for k, v in {"sizes": [1, 3], "zero": 0, "one": 1, "last": -1}.items()]
    nodes = [
        helper.make_node("SplitToSequence", ["x", "sizes"], ["s"], axis=1),
        helper.make_node("SequenceAt", ["s", "one"], ["a"]),
        helper.make_node("SplitToSequence", ["x"], ["u"], axis=0, keepdims=0),
        helper.make_node("SequenceAt", ["u", "last"], ["b"]),
        helper.make_node("SequenceConstruct", ["a", "a"], ["pair"]),
        helper.make_node("ConcatFromSequence", ["pair"], ["c"], axis=1),
        helper.make_node("ConcatFromSequence", ["u"], ["d"], axis=0, new_axis=1),
        helper.make_node("SequenceAt", ["s", "zero"], ["e"]),
    ]
    _run_both(nodes, {"x": rng.standard_normal((2, 4)).astype(np.float32)}, ["a", "b", "c", "d", "e"], 18, consts)
