"""bridge.pipeline.broadcast: one-element operands reshaped to the rank of the tensor they broadcast against
(onnxruntime's per-element broadcast loop), exactly, and only where onnxruntime takes that loop."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bridge.pipeline.broadcast import match_scalar_ranks

onnxruntime = pytest.importorskip("onnxruntime")


def _model(x_shape, scale_shape, computed=False):
    """y = x * scale, scale a one-element constant of ``scale_shape`` (or that constant negated: a computed value)."""
    scale = numpy_helper.from_array(np.full(scale_shape, 0.9, np.float32), "scale")
    nodes = [helper.make_node("Neg", ["scale"], ["neg"])] if computed else []
    nodes.append(helper.make_node("Mul", ["x", "neg" if computed else "scale"], ["y"], name="step/Mul"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)], initializer=[scale],
                              value_info=[helper.make_tensor_value_info("neg", TensorProto.FLOAT, scale_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rewritten(model):
    """``model`` rewritten, after checking it computes bit for bit what it did; and the count."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    run = lambda m: onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    before, rewritten = run(model), onnx.ModelProto()
    rewritten.CopyFrom(model)
    count = match_scalar_ranks(rewritten)
    onnx.checker.check_model(rewritten, full_check=True)
    np.testing.assert_array_equal(run(rewritten), before)
    return rewritten, count


@pytest.mark.parametrize("scale_shape", [[], [1], [1, 1]])
def test_a_constant_gets_the_rank_of_a_tensor_ending_in_ones(scale_shape):
    """A 1x1-conv weight [C_out, C_in, 1, 1] times Adam's 0-d beta: the constant becomes [1, 1, 1, 1]
    (the original, read by nothing else, is dropped)."""
    rewritten, count = _rewritten(_model([3, 2, 1, 1], scale_shape))
    assert count == 1
    assert [(t.name, list(t.dims)) for t in rewritten.graph.initializer] == [("scale_rank4", [1, 1, 1, 1])]
    assert list(rewritten.graph.node[0].input) == ["x", "scale_rank4"]


def test_a_constant_a_subgraph_reads_is_kept():
    model = _model([3, 2, 1, 1], [])
    branch = helper.make_graph([helper.make_node("Identity", ["scale"], ["s"])], "branch", [],
                               [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "c"))
    model.graph.node.append(helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, []))
    rewritten, count = _rewritten(model)
    assert count == 1
    assert [t.name for t in rewritten.graph.initializer] == ["scale", "c", "scale_rank4"]


def test_a_computed_value_is_reshaped_before_its_reader():
    rewritten, count = _rewritten(_model([3, 2, 1], [], computed=True))
    assert count == 1
    assert [n.op_type for n in rewritten.graph.node] == ["Neg", "Reshape", "Mul"]
    assert list(rewritten.graph.node[2].input) == ["x", "neg_rank3"]


@pytest.mark.parametrize("x_shape, scale_shape", [
    ([3, 2, 3, 3], []),        # last dim > 1: onnxruntime's scalar path
    ([3, 2, 1, 1], [1, 1, 1, 1]),  # same rank already
    ([3, 2, 1, 1], [2, 1, 1]),     # more than one element
    ([1, 1, 1], []),           # nothing to broadcast over
])
def test_left_alone_where_onnxruntime_broadcasts_fast(x_shape, scale_shape):
    rewritten, count = _rewritten(_model(x_shape, scale_shape))
    assert count == 0
    assert [list(t.dims) for t in rewritten.graph.initializer] == [scale_shape]


def test_a_converted_step_leaves_none(tmp_path):
    """A 1x1 conv's weight under Adam and a BatchNorm's ``var + eps`` ([1, C, 1, 1] + 0-d) in a converted
    step: the conversion has given every such operand its rank (running the rewrite again finds nothing)."""
    import torch

    import bridge

    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                 torch.nn.Linear(36, 3))
    path = tmp_path / "conv1x1.onnx"
    torch.onnx.export(module.eval(), (torch.randn(2, 2, 3, 3),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    step = bridge.to_training_onnx(str(path), loss="ce", optim="adam").model
    assert match_scalar_ranks(step) == 0
    assert any(node.name.endswith("/rank") for node in step.graph.node)  # Adam's computed bias corrections
