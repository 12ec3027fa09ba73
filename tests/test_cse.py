"""Dead-code and common-subexpression elimination on the traced step (bridge/pipeline/cse.py): fewer nodes, same numbers."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from helpers.models import _float_model, matmul_add_mlp
from onnx import helper
from torch.fx.experimental.proxy_tensor import make_fx

import bridge
import bridge.pipeline.trace
from bridge.pipeline.cse import eliminate_common_subexpressions, eliminate_dead_code

aten = torch.ops.aten


def _phase_ops(tm: bridge.TrainingModel, phase: str) -> Counter:
    graph = bridge.ir.load(tm.model)
    return Counter(node.op_type for node in graph.nodes(phase))


@pytest.mark.parametrize("optim", ["adam", "nadam", "radam"])
def test_step_scalars_once_per_step_and_bit_identical(optim, monkeypatch):
    model, _ = matmul_add_mlp()
    merged = bridge.to_training_onnx(model, loss="mse", optim=optim)
    monkeypatch.setattr(bridge.pipeline.trace, "eliminate_common_subexpressions", lambda graph: 0)
    plain = bridge.to_training_onnx(model, loss="mse", optim=optim)
    weights = len(merged.weights)
    assert weights == 3
    pows_merged, pows_plain = _phase_ops(merged, "optimizer")["Pow"], _phase_ops(plain, "optimizer")["Pow"]
    # beta ** step: once per weight (or more) before, once per step now
    assert pows_plain % weights == 0 and 0 < pows_merged <= pows_plain // weights
    assert len(merged.model.graph.node) < len(plain.model.graph.node)
    layers = {node.layer for node in bridge.ir.load(merged.model).nodes("optimizer") if node.op_type == "Pow"}
    assert layers == {"step"}

    rng = np.random.default_rng(0)
    sessions = merged.session(), plain.session()
    for _ in range(3):
        x, target = rng.standard_normal((4, 6), np.float32), rng.standard_normal((4, 3), np.float32)
        a, b = (s.step({"x": x}, target) for s in sessions)
        for key in a:
            assert np.array_equal(a[key], b[key]), key


def test_weights_with_one_gradient_keep_their_own_updates():
    """Two biases added one after the other have one gradient value; their Adam updates are the same ops on it,
    yet each weight's update stays its own layer: only per-step scalars (reading no gradient) are shared."""
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((6, 3)).astype(np.float32), "b1": rng.standard_normal(3).astype(np.float32),
               "b2": rng.standard_normal(3).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"), helper.make_node("Add", ["h", "b1"], ["h1"], name="bias1"),
             helper.make_node("Add", ["h1", "b2"], ["y"], name="bias2")]
    graph = bridge.ir.load(bridge.to_training_onnx(_float_model("two_biases", nodes, ("x", [4, 6]), ("y", [4, 3]), weights, 17),
                                                   loss="mse", optim="adam").model)
    gradients = set(graph.gradients.values())
    shared = [node.name for node in graph.nodes("optimizer", "step") if gradients & set(node.inputs)]
    assert not shared
    updates = {bias: Counter(node.op_type for node in graph.update_of(bias)) for bias in ("b1", "b2")}
    assert updates["b1"] == updates["b2"] == Counter(node.op_type for node in graph.update_of("W"))


def _graph(build) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return graph


def test_signed_zeros_and_written_temporaries_are_not_merged():
    def signed(graph, x):
        return (graph.call_function(aten.mul.Tensor, (x, 0.0)), graph.call_function(aten.mul.Tensor, (x, -0.0)))
    assert eliminate_common_subexpressions(_graph(signed)) == 0

    def written(graph, x):
        a = graph.call_function(aten.neg.default, (x,))
        b = graph.call_function(aten.neg.default, (x,))
        return (graph.call_function(aten.add_.Tensor, (a, x)), graph.call_function(aten.add_.Tensor, (b, x)))
    assert eliminate_common_subexpressions(_graph(written)) == 0

    def duplicated(graph, x):
        return (graph.call_function(aten.neg.default, (x,)), graph.call_function(aten.neg.default, (x,)))
    graph = _graph(duplicated)
    assert eliminate_common_subexpressions(graph) == 1
    (output,) = [n for n in graph.nodes if n.op == "output"]
    assert output.args[0][0] is output.args[0][1]


def test_dead_code_removes_what_torch_removes():
    """``eliminate_dead_code`` (each op's purity looked up once) removes the nodes torch's
    ``Graph.eliminate_dead_code`` removes: dead pure nodes, chains of them, a dead constant; never an in-place or
    random op, the inputs or the output."""

    def f(x, y):
        dead = torch.ops.aten.exp.default(torch.ops.aten.mul.Tensor(x, y))  # a dead chain
        torch.ops.aten.add.Tensor(dead, torch.ones(3))  # reads a constant, dead
        torch.ops.aten.add_.Tensor(torch.ops.aten.clone.default(x), 1.0)  # in place: kept, with its input
        torch.ops.aten.bernoulli.default(y)  # random: kept
        return torch.ops.aten.mul.Tensor(x, 2.0)

    ours, torchs = (make_fx(f)(torch.randn(3), torch.rand(3)) for _ in range(2))
    removed = eliminate_dead_code(ours.graph)
    torchs.graph.eliminate_dead_code()
    assert removed >= 4
    assert [(n.op, n.target) for n in ours.graph.nodes] == [(n.op, n.target) for n in torchs.graph.nodes]
    assert {torch.ops.aten.add_.Tensor, torch.ops.aten.bernoulli.default} <= {n.target for n in ours.graph.nodes}


def test_backward_reads_the_forward_values_it_would_recompute(monkeypatch):
    """The backward's copies of forward and loss values merge into them (one half of the step):
    tiled max pooling's backward reads the forward's MaxPool, cross-entropy's backward its target
    mask; the optimizer's nodes stay apart. Every output is bit-identical to the unmerged step."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                 torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    example = torch.randn(5, 2, 8, 8)
    merged = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=example)
    monkeypatch.setattr(bridge.pipeline.trace, "eliminate_common_subexpressions", lambda graph: 0)
    plain = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=example)

    def ops(tm, op_type):
        return Counter(node.phase for node in bridge.ir.load(tm.model).nodes() if node.op_type == op_type)

    assert ops(merged, "MaxPool") == Counter({"forward": 1, "backward": 1})  # the backward's second: a max of keys
    assert ops(plain, "MaxPool") == Counter({"forward": 1, "backward": 2})
    assert ops(merged, "Equal")["backward"] < ops(plain, "Equal")["backward"]

    rng = np.random.default_rng(0)
    sessions = merged.session(), plain.session()
    for _ in range(3):
        x, target = rng.standard_normal((5, 2, 8, 8), np.float32), rng.integers(0, 3, 5)
        a, b = (s.step({merged.data_inputs[0]: x}, target) for s in sessions)
        assert a.keys() == b.keys()
        for key in a:
            assert np.array_equal(a[key], b[key]), key


def test_a_conv_weight_read_as_rows_forward_and_backward_is_one_view():
    """A Conv whose forward is one product with the weight as ``[Cout, Cin*K]`` rows (a 2x2 output plane) and whose
    input gradient reads the same rows (onnxruntime's select form, many output channels): one Reshape of the weight
    serves both."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 8, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.Conv2d(8, 64, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(64 * 2 * 2, 3))
    tm = bridge.to_training_onnx(module, loss="ce", optim="sgd", example_inputs=torch.randn(4, 2, 2, 2))
    graph = bridge.ir.load(tm.model)
    weight = next(name for name in graph.weights if name.endswith("2.weight"))
    rows = [node for node in graph.nodes() if node.op_type == "Reshape" and weight in node.inputs]
    assert len(rows) == 1 and {user.phase for user in graph.consumers(rows[0].outputs[0])} == {"forward", "backward"}
