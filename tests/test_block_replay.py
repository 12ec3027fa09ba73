"""Whole-block replay (bridge.pipeline.replay.BlockReplay): a repeated block of the ONNX graph is traced once and
replayed, forward and backward, for the blocks that differ from it only in their weights; the step is the one
tracing every block gives, bit for bit, and torch's. Blocks that differ in one attribute or one constant are
traced each."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import bridge_steps, random_batches
from helpers.training import assert_trains_like
from onnx import TensorProto, helper, numpy_helper

import bridge
import bridge.pipeline.replay


class _Residual(torch.nn.Module):
    """Conv, BatchNorm, ReLU, Conv, BatchNorm, the residual, ReLU (resnet's basic block)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1, self.norm2 = torch.nn.BatchNorm2d(channels), torch.nn.BatchNorm2d(channels)
        for norm in (self.norm1, self.norm2):  # distinct: the exporter de-duplicates equal initializers
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
            torch.nn.init.uniform_(norm.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))


def _convert(path: str, monkeypatch, replay: bool, **options) -> tuple[bridge.TrainingModel, int, int]:
    """The conversion, how many blocks went through ``BlockReplay`` and how many of them were traced;
    ``replay=False``: every block traced as it is."""
    calls, traced = [], []
    run = bridge.pipeline.replay.BlockReplay.run

    def counting(self, key, tensors, layers, fn):
        calls.append(layers)
        if not replay:
            return fn(list(tensors))
        return run(self, key, tensors, layers, lambda inputs: traced.append(layers) or fn(inputs))

    with monkeypatch.context() as patch:
        patch.setattr(bridge.pipeline.replay.BlockReplay, "run", counting)
        tm = bridge.to_training_onnx(path, **options)
    return tm, len(calls), len(traced)


def _assert_same_steps(replayed: bridge.TrainingModel, traced: bridge.TrainingModel, batches) -> None:
    """Every output of every step (loss, gradients, updated weights, buffers and state) equal, bit for bit."""
    for step, (got, want) in enumerate(zip(bridge_steps(replayed, batches), bridge_steps(traced, batches),
                                           strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step}: {name}")


@pytest.fixture(scope="module")
def resnet(tmp_path_factory) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                 *(_Residual(8) for _ in range(3)),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    path = tmp_path_factory.mktemp("resnet") / "resnet.onnx"
    torch.onnx.export(module.eval(), (torch.randn(4, 3, 6, 6),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], do_constant_folding=False)
    return str(path), module.train()


def test_blocks_alike_but_for_weights_are_replayed_and_train_like_torch(resnet, monkeypatch):
    path, module = resnet
    options = {"loss": "ce", "optim": "sgd", "optim_options": {"lr": 0.01}}
    replayed, blocks, traced = _convert(path, monkeypatch, replay=True, **options)
    assert blocks >= 3 and traced == blocks - 2, "the second and third residual blocks are replays of the first"
    every, _, _ = _convert(path, monkeypatch, replay=False, **options)
    batches = random_batches(replayed, 2, classes=5)
    _assert_same_steps(replayed, every, batches)
    assert_trains_like(replayed, module, batches, F.cross_entropy, torch.optim.SGD, {"lr": 0.01})


def _stack(alphas: list[float], scales: list[float]) -> onnx.ModelProto:
    """A MatMul, then residual blocks ``x + scale * LeakyRelu(x @ W, alpha)``, one per (alpha, scale), each with its
    own ``W``; the scale a Constant node (a value known before the model runs, not a weight)."""
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32), "stem")]
    nodes, x = [helper.make_node("MatMul", ["x", "stem"], ["h"], name="stem")], "h"
    for index, (alpha, scale) in enumerate(zip(alphas, scales, strict=True)):
        weight = f"w{index}"
        initializers.append(numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32) * 0.5, weight))
        nodes += [helper.make_node("Constant", [], [f"s{index}"], name=f"scale{index}",
                                   value=numpy_helper.from_array(np.array(scale, np.float32))),
                  helper.make_node("MatMul", [x, weight], [f"m{index}"], name=f"matmul{index}"),
                  helper.make_node("LeakyRelu", [f"m{index}"], [f"r{index}"], name=f"relu{index}", alpha=alpha),
                  helper.make_node("Mul", [f"r{index}", f"s{index}"], [f"p{index}"], name=f"mul{index}"),
                  helper.make_node("Add", [x, f"p{index}"], [f"x{index}"], name=f"add{index}")]
        x = f"x{index}"
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, 6])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("differing", ["attribute", "constant"])
def test_blocks_differing_in_an_attribute_or_a_constant_are_not_replayed_as_each_other(tmp_path, monkeypatch,
                                                                                        differing):
    alphas, scales = [0.1] * 4, [0.5] * 4
    (alphas if differing == "attribute" else scales)[2] = 0.2  # the third block differs from the others
    path = tmp_path / "stack.onnx"
    onnx.save(_stack(alphas, scales), str(path))
    options = {"loss": "mse", "optim": "sgd", "optim_options": {"lr": 0.1}}
    replayed, blocks, traced = _convert(str(path), monkeypatch, replay=True, **options)
    assert traced + 4 - blocks == 2, "blocks 2 and 4 are replays of block 1; block 3 is traced"
    every, _, _ = _convert(str(path), monkeypatch, replay=False, **options)
    _assert_same_steps(replayed, every, random_batches(replayed, 2))


def _shape_scaled_stack(blocks: int) -> onnx.ModelProto:
    """``_stack``'s blocks, each also scaled by the size of its own ``v`` (a weight read only through Shape: it
    reaches the output, but not differentiably)."""
    model = _stack([0.1] * blocks, [0.5] * blocks)
    graph, rng = model.graph, np.random.default_rng(1)
    for index in range(blocks):
        graph.initializer.append(numpy_helper.from_array(rng.standard_normal((3,)).astype(np.float32), f"v{index}"))
        add = next(node for node in graph.node if node.name == f"add{index}")
        add.input[1] = f"q{index}"
        at = list(graph.node).index(add)
        for offset, node in enumerate([
                helper.make_node("Shape", [f"v{index}"], [f"n{index}"], name=f"shape{index}"),
                helper.make_node("Cast", [f"n{index}"], [f"c{index}"], name=f"cast{index}", to=TensorProto.FLOAT),
                helper.make_node("Mul", [f"p{index}", f"c{index}"], [f"q{index}"], name=f"scaled{index}")]):
            graph.node.insert(at + offset, node)
    return model


@pytest.mark.parametrize("model", ["resnet", "shape-scaled stack"])
def test_the_example_run_on_fakes_shows_what_running_every_block_shows(resnet, monkeypatch, model):
    """The conversion's example run on fake tensors (``bridge.api._probe``) runs a repeated block until two of its key
    agree and then gives later ones only their results' layouts and autograd links (``BlockLayouts``): it finds the
    same trained weights (not a weight read only through Shape), updated buffers and output as running every block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bridge.pipeline.importer.program import OnnxProgram
    from bridge.pipeline.importer.weights import example_run

    source = onnx.load(resnet[0]) if model == "resnet" else _shape_scaled_stack(5)
    inputs = {"x": torch.randn(4, 3, 6, 6) if model == "resnet" else torch.randn(4, 6)}
    run = bridge.pipeline.replay.BlockLayouts.run
    ran: list[int] = []

    def probe(every: bool):
        def counting(self, key, tensors, layers, fn):
            return fn(list(tensors)) if every else run(self, key, tensors, layers, lambda t: ran.append(1) or fn(t))

        with monkeypatch.context() as patch, FakeTensorMode(allow_non_fake_inputs=True):
            patch.setattr(bridge.pipeline.replay.BlockLayouts, "run", counting)
            found = example_run(OnnxProgram(source), inputs, 0)
        return found.differentiable, found.buffers, list(found.random), found.output.shape, found.output.dtype

    skipping, every = probe(every=False), probe(every=True)
    assert skipping == every
    blocks = 3 if model == "resnet" else 5
    assert len(ran) == 2, f"{blocks} blocks alike: the first two run, the others are skipped"
    if model == "shape-scaled stack":
        assert sorted(skipping[0]) == sorted(["stem", *(f"w{index}" for index in range(5))])
