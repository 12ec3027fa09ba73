"""The clean-up of exported step graphs (bridge.pipeline.cleanup): each rewrite, exact, and where it must not apply;
and the moves the exporter's builder leaves out (a reshape of a reshape or of a constant), exact too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from bridge.pipeline.cleanup import clean_up
from bridge.pipeline.export.builder import GraphBuilder, Value

onnxruntime = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
                              initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model, feed):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _cleaned(model, feed):
    """``model`` cleaned, after checking it computes bit for bit what it did."""
    before = _run(model, feed)
    cleaned = onnx.ModelProto()
    cleaned.CopyFrom(model)
    counts = clean_up(cleaned)
    onnx.checker.check_model(cleaned, full_check=True)
    for want, got in zip(before, _run(cleaned, feed), strict=True):
        np.testing.assert_array_equal(got, want)
    return cleaned, counts


def _shape(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


FEED = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}


def test_transposes_that_cancel_vanish_and_a_graph_output_keeps_its_name():
    """The Gemm weight's pattern: t(W) read by the forward, t(t(W)) by the backward; and a gradient
    computed transposed then transposed back into a graph output."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
             helper.make_node("Relu", ["t"], ["forward"]),
             helper.make_node("Transpose", ["t"], ["tt"], perm=[1, 2, 0]),
             helper.make_node("Neg", ["tt"], ["backward"]),
             helper.make_node("Abs", ["x"], ["a"]),
             helper.make_node("Transpose", ["a"], ["at"], perm=[2, 1, 0]),
             helper.make_node("Transpose", ["at"], ["grad"], perm=[2, 1, 0])]
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("forward", [4, 2, 3]), ("backward", [2, 3, 4]), ("grad", [2, 3, 4])]), FEED)
    assert counts == {"Transpose pair": 2, "dead node": 2}
    assert [n.op_type for n in cleaned.graph.node] == ["Transpose", "Relu", "Neg", "Abs"]
    assert cleaned.graph.node[3].output[0] == "grad"


def test_transposes_that_do_not_cancel_become_one():
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
             helper.make_node("Transpose", ["t"], ["y"], perm=[2, 0, 1])]
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("y", [3, 4, 2])]), FEED)
    assert counts == {"Transpose pair": 1, "dead node": 1}
    assert [list(n.attribute[0].ints) for n in cleaned.graph.node] == [[1, 2, 0]]


def test_a_reshape_chain_collapses_unless_the_outer_shape_copies_a_dim():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r1"]),
             helper.make_node("Reshape", ["r1", "s2"], ["y"]),
             helper.make_node("Reshape", ["r1", "s0"], ["z"])]  # 0: copy dim 0 of r1 (6), not of x (2)
    inits = [_shape("s1", [6, 4]), _shape("s2", [4, -1]), _shape("s0", [0, 2, 2])]
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("y", [4, 6]), ("z", [6, 2, 2])], inits), FEED)
    assert counts == {"Reshape chain": 1}
    assert [list(n.input) for n in cleaned.graph.node] == [["x", "s1"], ["x", "s2"], ["r1", "s0"]]


def test_an_identity_is_bypassed_and_its_shape_constant_dropped():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r1"]),
             helper.make_node("Reshape", ["r1", "s2"], ["r2"]),
             helper.make_node("Identity", ["r2"], ["i"]),
             helper.make_node("Neg", ["i"], ["y"])]
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("y", [24])], [_shape("s1", [6, 4]), _shape("s2", [24])]),
                               FEED)
    assert counts == {"Identity": 1, "Reshape chain": 1, "dead node": 2}
    assert [n.op_type for n in cleaned.graph.node] == ["Reshape", "Neg"]
    assert [t.name for t in cleaned.graph.initializer] == ["s2"]


def test_a_value_a_subgraph_reads_is_left_alone():
    branch = helper.make_graph([helper.make_node("Neg", ["i"], ["b"])], "branch", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3, 4])])
    nodes = [helper.make_node("Identity", ["x"], ["i"]),
             helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)]
    zero = numpy_helper.from_array(np.array(0, np.float32), "zero")
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("y", [2, 3, 4])], [zero]), FEED)
    assert counts == {} and len(cleaned.graph.node) == 4


def test_builder_reshapes_of_reshapes_and_of_constants_hold_numpy_s_values():
    """``GraphBuilder.reshape`` of a static reshape reads its source, and of a constant makes a constant: the
    values onnxruntime computes are numpy's reshapes of the input and of the constant."""
    b = GraphBuilder()
    x = Value("x", (1, 3, 1, 1), torch.float32)
    flat = b.reshape(x, [3])
    table = b.const(np.arange(6, dtype=np.float32))
    results = [flat, b.reshape(flat, [1, 3, 1, 1]), b.reshape(b.reshape(flat, [3, 1]), [1, 3]),
               b.reshape(b.reshape(table, [2, 3]), [3, 2])]
    outputs = [b.op("Identity", value) for value in results]
    feed = np.array([1.5, -2.0, 3.25], np.float32).reshape(1, 3, 1, 1)
    want = [feed.reshape(3), feed, feed.reshape(1, 3), np.arange(6, dtype=np.float32).reshape(3, 2)]
    graph = helper.make_graph(b.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 1, 1])],
                              [helper.make_tensor_value_info(str(out), TensorProto.FLOAT, value.shape)
                               for out, value in zip(outputs, want, strict=True)])
    b.write_initializers(graph)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    for got, expected in zip(_run(model, {"x": feed}), want, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_moves_that_only_dead_moves_read_are_dead_too():
    """A chain of moves nothing reads in the end (Transpose -> Reshape -> Identity) goes as a whole; a move that a
    graph output or a live node reads stays."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
             helper.make_node("Reshape", ["t", "s"], ["r"]),
             helper.make_node("Identity", ["r"], ["unread"]),
             helper.make_node("Transpose", ["x"], ["kept"], perm=[1, 0, 2]),
             helper.make_node("Relu", ["kept"], ["y"])]
    cleaned, counts = _cleaned(_model(nodes, [("x", [2, 3, 4])], [("y", [3, 2, 4])], [_shape("s", [4, 6])]), FEED)
    assert counts == {"Identity": 1, "dead node": 3}  # the Identity is bypassed first, then dead like the rest
    assert [n.op_type for n in cleaned.graph.node] == ["Transpose", "Relu"]
