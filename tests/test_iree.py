"""Training graphs compiled by an MLIR compiler (IREE, llvm-cpu) train like onnxruntime.

Each model family's training graph is compiled once per module, run for 3 steps with the
state fed back, and every output (loss, grad_*, updated_*) is compared with the same steps in
onnxruntime (which tests/test_*.py compare with PyTorch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.cli import main as cli_main
from bridge.runtime_iree import IreeTrainingSession
from reference import assert_steps_match, bridge_steps, random_batches


@dataclass
class Family:
    """A small model of one family, exported by torch, and how it is trained."""

    build: Callable[[], tuple[torch.nn.Module, torch.Tensor]]
    loss: str
    optim: str
    classes: int | None = None
    optim_options: dict = field(default_factory=lambda: {"lr": 0.05})


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)), torch.randn(5, 6)


FAMILIES = {
    "mlp_adam_ce": Family(_mlp, "ce", "adam", classes=4),
    "mlp_sgd_mse": Family(_mlp, "mse", "sgd", optim_options={"lr": 0.05, "momentum": 0.9}),
}
# Batch modes: keyword arguments of to_training_onnx.
BATCH_MODES = {"static": {}}


@dataclass
class Compiled:
    tm: bridge.TrainingModel
    compiled: bridge.CompiledModel
    batches: list


@pytest.fixture(scope="module", params=[(f, b) for f in FAMILIES for b in BATCH_MODES], ids=lambda p: f"{p[0]}-{p[1]}")
def compiled(request, tmp_path_factory) -> Compiled:
    family_name, batch_mode = request.param
    family = FAMILIES[family_name]
    torch.manual_seed(0)
    module, example = family.build()
    path = tmp_path_factory.mktemp(family_name) / "model.onnx"
    torch.onnx.export(module.eval(), (example,), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    tm = bridge.to_training_onnx(str(path), loss=family.loss, optim=family.optim,
                                 optim_options=family.optim_options, **BATCH_MODES[batch_mode])
    return Compiled(tm, bridge.compile(tm), random_batches(tm, 3, classes=family.classes))


def test_compiled_steps_match_onnxruntime(compiled):
    session = compiled.compiled.session()
    got = [session.step(inputs, target) for inputs, target in compiled.batches]
    want = bridge_steps(compiled.tm, compiled.batches)
    assert set(got[0]) == set(want[0]) == {o.name for o in compiled.tm.model.graph.output}
    assert_steps_match(got, want)


def test_emitted_graph_avoids_known_iree_defects(compiled):
    """ConvTranspose with asymmetric pads or output_shape, MaxPool Indices, Gelu(tanh), Dropout."""
    for node in compiled.tm.model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        where = f"{node.name} ({node.op_type})"
        if node.op_type == "ConvTranspose":
            pads = list(attrs.get("pads", []))
            assert "output_shape" not in attrs and pads[: len(pads) // 2] == pads[len(pads) // 2:], where
        assert not (node.op_type == "MaxPool" and len([o for o in node.output if o]) > 1), where
        assert not (node.op_type == "Gelu" and attrs.get("approximate") == b"tanh"), where
        assert node.op_type != "Dropout", where


def test_lr_change_reaches_compiled_step(compiled):
    """The lr input is live: a session stepped at lr=0 leaves every weight unchanged."""
    session = compiled.compiled.session()
    session.lr = 0.0
    before = {w: session.state[w].copy() for w in compiled.tm.weights}
    session.step(*compiled.batches[0])
    for w in compiled.tm.weights:
        np.testing.assert_array_equal(session.state[w], before[w], err_msg=w)


def test_cli_compile_and_mlir_make_a_self_describing_module(tmp_path):
    torch.manual_seed(0)
    module, example = _mlp()
    source = tmp_path / "mlp.onnx"
    torch.onnx.export(module.eval(), (example,), str(source), dynamo=False, input_names=["x"], output_names=["y"])
    train = tmp_path / "train.onnx"
    assert cli_main(["convert", str(source), "-o", str(train), "--loss", "ce", "--optim", "rmsprop"]) == 0
    assert cli_main(["compile", str(train), "--backend", "iree", "-o", str(tmp_path / "train.vmfb")]) == 0
    assert cli_main(["mlir", str(train), "-o", str(tmp_path / "train.mlir")]) == 0
    text = (tmp_path / "train.mlir").read_text()
    assert 'torch.operator "onnx.Gemm"' in text or 'torch.operator "onnx.MatMul"' in text
    assert 'loc("' in text, "ONNX node names are the MLIR locations"

    state = dict(np.load(tmp_path / "train.state.npz"))
    iree = IreeTrainingSession(tmp_path / "train.vmfb", state)
    ort = bridge.TrainingSession(str(train), state)
    model = onnx.load(str(train))
    assert iree.input_names == [i.name for i in model.graph.input]
    assert iree.output_names == [o.name for o in model.graph.output]
    rng = np.random.default_rng(0)
    for _ in range(3):
        inputs = {"x": rng.standard_normal((5, 6)).astype(np.float32)}
        target = rng.integers(0, 4, size=5).astype(np.int64)
        assert_steps_match([iree.step(inputs, target)], [ort.step(inputs, target)])


def test_compile_error_names_the_offending_node():
    weight = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "W")
    node = helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="decoder/up/ConvTranspose",
                            strides=[2, 2], output_shape=[8, 8])
    graph = helper.make_graph([node], "convtranspose_output_shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(bridge.CompileError, match=r"node 'decoder/up/ConvTranspose' \(ConvTranspose\)"):
        bridge.compile(model)


def test_bad_arguments_raise_bridge_errors(tmp_path):
    with pytest.raises(bridge.InvalidOptionError, match="backend='tvm'"):
        bridge.compile(tmp_path / "missing.onnx", backend="tvm")
    with pytest.raises(bridge.ModelLoadError, match="missing.onnx"):
        bridge.compile(tmp_path / "missing.onnx")
    (tmp_path / "junk.vmfb").write_bytes(b"not a module")
    with pytest.raises(bridge.ModelLoadError, match="IREE module"):
        IreeTrainingSession(tmp_path / "junk.vmfb", {})
