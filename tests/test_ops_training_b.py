"""Training through shape and data-movement ops: Pad (reflect / edge / wrap), strided Slice,
Flatten, sequences, BatchNormalization with training_mode, a padded LM at a symbolic batch,
and a sweep of every op of importer/ops/{tensor,sequence,indexing}.py behind a trainable weight.

Each op gets a trainable ``w_pre`` in front of it (``Mul(x, w_pre)``). Two oracles:
``train_and_compare`` against a torch twin (torch.nn.functional, float64, real torch.optim) and
``_check_against_finite_differences``: the loss against onnxruntime running the inference model
(forward semantics) and ``grad_w_pre`` against float64 central differences of that loss.
"""
from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import run_onnxruntime
from helpers.reference import assert_steps_match, bridge_steps, torch_steps
from helpers.single_op import batches_for, one_node_model, train_and_compare
from helpers.training import assert_trains_like, module_weights

import bridge

RTOL = 1e-12  # float64 vs torch float64: measured <= 1e-15 relative
RTOL32 = 1e-5  # float32 vs torch float32: measured <= 3.4e-7 relative (a few ulps)
# Central differences with EPS on a float64 loss: measured error <= 5e-9 of the largest gradient.
FD_EPS, FD_RTOL = 1e-6, 1e-6
rng = np.random.default_rng(0)


def _ints(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _prescaled(op: str, x: np.ndarray, inits: dict, opset: int = 18, outputs: int = 1, **attrs) -> onnx.ModelProto:
    """``op(Mul(x, w_pre), *inits)``, float64, ``w_pre`` positive (keeps signs, moves values)."""
    prescale = np.abs(rng.standard_normal(x.shape)) + 0.5
    return one_node_model(op, ["x"] + list(inits), {"x": x}, inits, opset, outputs=outputs, prescale=prescale, **attrs)


def _fd_grad(model: onnx.ModelProto, feed: dict, target: np.ndarray) -> np.ndarray:
    """d mse(model(x), target) / d w_pre by central differences, the model run by onnxruntime."""
    weight = next(onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name == "w_pre")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    kept = [i for i in probe.graph.initializer if i.name != "w_pre"]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    probe.graph.input.append(onnx.helper.make_tensor_value_info("w_pre", onnx.TensorProto.DOUBLE, weight.shape))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])

    def loss(w: np.ndarray) -> float:
        return float(np.mean((session.run(None, {**feed, "w_pre": w})[0] - target) ** 2))

    grad = np.zeros_like(weight)
    for index in np.ndindex(weight.shape):
        up, down = weight.copy(), weight.copy()
        up[index] += FD_EPS
        down[index] -= FD_EPS
        grad[index] = (loss(up) - loss(down)) / (2 * FD_EPS)
    return grad


def _check_against_finite_differences(model: onnx.ModelProto, x: np.ndarray) -> bridge.TrainingModel:
    """Converts with mse + sgd; onnx-mlir's table holds; the loss is mse of onnxruntime's forward
    and ``grad_w_pre`` the float64 finite differences of it."""
    feed = {"x": x}
    forward = run_onnxruntime(model, feed)[0]
    target = rng.standard_normal(forward.shape)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    out = tm.session().step(feed, target)
    np.testing.assert_allclose(out["loss"], np.mean((forward - target) ** 2), rtol=RTOL)
    want = _fd_grad(model, feed, target)
    np.testing.assert_allclose(out["grad_w_pre"], want, rtol=0, atol=FD_RTOL * np.abs(want).max())
    return tm


def _train_prescaled(model: onnx.ModelProto, x_shape: tuple, op, steps: int = 2) -> None:
    """Several SGD steps vs torch: the twin is ``op(w_pre * x)`` in torch."""
    weights = {"w_pre": next(onnx.numpy_helper.to_array(i) for i in model.graph.initializer if i.name == "w_pre")}
    out_shape = tuple(op(torch.zeros(x_shape, dtype=torch.float64)).shape)
    train_and_compare(model, weights, lambda p, i: op(p["w_pre"] * i["x"]), batches_for({"x": x_shape}, out_shape, steps),
                      steps_rtol=RTOL)


# -- Pad: reflect / edge / wrap ------------------------------------------------------------

TORCH_MODE = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}
PADDED = [  # x shape, ONNX pads (all begins, then all ends), torch pads (last dim first)
    pytest.param((2, 3, 7), [0, 0, 2, 0, 0, 3], (2, 3), id="1d"),
    pytest.param((2, 3, 5, 6), [0, 0, 1, 2, 0, 0, 3, 1], (2, 1, 1, 3), id="2d"),
    pytest.param((1, 2, 3, 4, 5), [0, 0, 1, 2, 1, 0, 0, 2, 1, 3], (1, 3, 2, 1, 1, 2), id="3d"),
]


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize("shape, pads, torch_pads", PADDED)
def test_pad_modes_train_like_torch(mode, shape, pads, torch_pads):
    model = _prescaled("Pad", np.zeros(shape), {"pads": _ints(*pads)}, opset=19, mode=mode)
    _train_prescaled(model, shape, lambda t: F.pad(t, torch_pads, mode=TORCH_MODE[mode]))


FD_PADS = [  # pads, axes (None: all)
    pytest.param([1, 0, 2, 1, 0, 1], None, id="all-axes"),  # leading axes too (torch's modes pad only the last 1-3)
    pytest.param([2, -1], [-1], id="axes-crop"),  # the axes input, a crop on one side
]


@pytest.mark.parametrize("mode, pads, axes", [pytest.param(m, *c.values, id=f"{m}-{c.id}") for m in TORCH_MODE for c in FD_PADS]
                         + [pytest.param("wrap", [0, 3, 0, 9], [1, 2], id="wrap-longer-than-axis")])
def test_pad_modes_match_finite_differences(mode, pads, axes):
    x = rng.standard_normal((2, 3, 4))
    inits = {"pads": _ints(*pads)}
    if axes is not None:
        inits.update(value=np.array(0.0), axes=_ints(*axes))
    _check_against_finite_differences(_prescaled("Pad", x, inits, opset=19, mode=mode), x)


def test_reflect_pad_past_the_axis_is_a_shape_error():
    model = one_node_model("Pad", ["x", "pads"], {"x": np.zeros((2, 3))}, {"pads": _ints(0, 3, 0, 0)}, 18,
                           name="pad3", mode="reflect", out_shape=[2, 6])
    with pytest.raises(bridge.BridgeError, match="pad3.*reflect.*axis 1 of length 3"):
        bridge.to_training_onnx(model, loss="mse", optim="sgd")


def _exported(module: torch.nn.Module, example: torch.Tensor, **kwargs) -> onnx.ModelProto:
    buffer = io.BytesIO()
    torch.onnx.export(module, (example,), buffer, dynamo=False, do_constant_folding=False, input_names=["x"],
                      output_names=["y"], **kwargs)
    return onnx.load_from_string(buffer.getvalue())


def test_reflect_padded_conv1d_module_trains_like_torch():
    """A real export: nn.ReflectionPad1d then nn.Conv1d(padding_mode="reflect"), 3 SGD steps."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.ReflectionPad1d(2), torch.nn.Conv1d(3, 4, 3, padding=1, padding_mode="reflect"))
    model = _exported(module, torch.zeros(2, 3, 9), opset_version=17)  # float32: onnxruntime has no float64 Conv
    assert "reflect" in str([n.attribute for n in model.graph.node if n.op_type == "Pad"])
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    assert sorted(tm.weights) == sorted(module_weights(module))
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    batches = batches_for({"x": (2, 3, 9)}, (2, 4, 13), 3, dtype=np.float32)
    assert_trains_like(tm, module, batches, F.mse_loss, torch.optim.SGD, {"lr": 0.125}, rtol=RTOL32)


# -- Slice with steps, Flatten with a negative axis ------------------------------------------

def _python_slice(t: torch.Tensor, starts, ends, axes, steps) -> torch.Tensor:
    """ONNX Slice by Python's own slice clamping, as explicit indices (torch has no negative steps)."""
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        kept = list(range(t.shape[axis]))[slice(start, end, step)]
        t = t.index_select(axis, torch.tensor(kept, dtype=torch.int64))
    return t


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([-1], [-100], [3], [-2]),  # clamped end
    ([3, 4], [0, -100], [2, 3], [-2, -3]),  # several axes
    ([10, -1], [-10, 0], [1, 3], [-2, -4]),  # clamped start
    ([0, 1], [100, 4], [1, 3], [2, 2]),  # positive steps
    ([-2, 3], [-100, 1], [0, 2], [-1, -3]),
])
def test_strided_slice_trains_like_torch(starts, ends, axes, steps):
    shape = (2, 3, 4, 5)
    inits = {"starts": _ints(*starts), "ends": _ints(*ends), "axes": _ints(*axes), "steps": _ints(*steps)}
    model = _prescaled("Slice", np.zeros(shape), inits)
    _train_prescaled(model, shape, lambda t: _python_slice(t, starts, ends, axes, steps))


@pytest.mark.parametrize("axis", [-1, -3, -4, 0, 2, 4])
def test_flatten_axis_trains_like_torch(axis):
    shape = (2, 3, 4, 5)
    split = axis + len(shape) if axis < 0 else axis
    model = _prescaled("Flatten", np.zeros(shape), {}, axis=axis)
    _train_prescaled(model, shape, lambda t: t.reshape(int(np.prod(shape[:split])), -1))


# -- Sequences -------------------------------------------------------------------------------

def _sequence_model(nodes: list, x_shape: tuple, inits: dict, opset: int = 18) -> onnx.ModelProto:
    """``Mul(x, w_pre) -> pre`` then ``nodes`` (ending in ``y``), float64."""
    weight = np.abs(rng.standard_normal(x_shape)) + 0.5
    nodes = [onnx.helper.make_node("Mul", ["x", "w_pre"], ["pre"])] + nodes
    inits = {"w_pre": weight, **inits}
    graph = onnx.helper.make_graph(
        nodes, "sequence", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, x_shape)],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = onnx.shape_inference.infer_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)]))
    onnx.checker.check_model(model, full_check=True)
    return model


def test_identity_of_a_sequence_keeps_every_tensor():
    """SplitToSequence -> Identity -> ConcatFromSequence(new_axis=1): the stacked halves."""
    shape = (2, 3, 4)
    model = _sequence_model([
        onnx.helper.make_node("SplitToSequence", ["pre", "split"], ["seq"], axis=2),
        onnx.helper.make_node("Identity", ["seq"], ["same"]),
        onnx.helper.make_node("ConcatFromSequence", ["same"], ["y"], axis=1, new_axis=1),
    ], shape, {"split": _ints(2, 2)})
    _train_prescaled(model, shape, lambda t: torch.stack(torch.split(t, 2, dim=2), dim=1))


# -- BatchNormalization with training_mode=1 --------------------------------------------------

@pytest.mark.parametrize("opset", [14, 15])
def test_batch_norm_training_mode_outputs_train_like_torch(opset):
    """training_mode=1 with its running_mean / running_var outputs: bridge's buffers follow torch
    (unbiased running variance), the node's outputs the ONNX spec (see test_importer_ops)."""
    shape, momentum, eps = (4, 3, 5), 0.75, 1e-5
    scale, bias, mean, var = rng.standard_normal(3), rng.standard_normal(3), rng.standard_normal(3), rng.random(3) + 0.5
    model = one_node_model("BatchNormalization", ["x", "s", "b", "rm", "rv"], {"x": np.zeros(shape)},
                           {"s": scale, "b": bias, "rm": mean, "rv": var}, opset, outputs=3, epsilon=eps,
                           momentum=momentum, training_mode=1)
    running = {"rm": torch.tensor(mean), "rv": torch.tensor(var)}
    history = []

    def twin(p, inputs):
        out = F.batch_norm(inputs["x"], running["rm"], running["rv"], p["s"], p["b"], training=True,
                           momentum=1 - momentum, eps=float(np.float32(eps)))
        history.append({k: v.clone().numpy() for k, v in running.items()})
        return out

    _, got = train_and_compare(model, {"s": scale, "b": bias}, twin, batches_for({"x": shape}, shape, 2), steps_rtol=RTOL)
    for step, (g, w) in enumerate(zip(got, history, strict=True)):
        np.testing.assert_allclose(g["updated_rm"], w["rm"], rtol=RTOL, err_msg=f"step {step}")
        np.testing.assert_allclose(g["updated_rv"], w["rv"], rtol=RTOL, err_msg=f"step {step}")


# -- A language model with a shifted, padded output at a symbolic batch ------------------------

class _ShiftedLM(torch.nn.Module):
    """Embedding -> Linear; logits of positions 0..T-2 moved to 1..T-1, position 0 padded
    (F.pad along the sequence dim), so position t predicts token t from tokens < t."""

    def __init__(self, vocab: int = 11, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Parameter(torch.randn(vocab, width, dtype=torch.float64))
        self.head = torch.nn.Parameter(torch.randn(width, vocab, dtype=torch.float64) / width**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(vocab, dtype=torch.float64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = F.embedding(tokens, self.embedding) @ self.head + self.bias
        return F.pad(logits[:, :-1], (0, 0, 1, 0))


@pytest.fixture(scope="module")
def shifted_lm() -> tuple[_ShiftedLM, bridge.TrainingModel]:
    module = _ShiftedLM()
    model = _exported(module, torch.zeros(2, 6, dtype=torch.int64), opset_version=17,
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    tm = bridge.to_training_onnx(model, loss="ce", optim="sgd", optim_options={"lr": 0.5}, dynamic_batch=True)
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    return module, tm


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_shifted_lm_trains_like_torch_at_any_batch(shifted_lm, batch):
    module, tm = shifted_lm
    assert sorted(tm.weights) == sorted(module_weights(module))
    batch_rng = np.random.default_rng(batch)
    batches = []
    for _ in range(2):
        tokens = batch_rng.integers(0, 11, (batch, 6))
        labels = F.pad(torch.tensor(tokens[:, 1:]), (1, 0), value=-100).numpy()  # no label at position 0
        batches.append(({"x": tokens}, labels))

    def loss(output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    assert_trains_like(tm, module, batches, loss, torch.optim.SGD, {"lr": 0.5}, rtol=RTOL)


# -- The same ops at a symbolic batch ----------------------------------------------------------

# A float64 model at a symbolic batch: the loss mean's 1 / N is built in float32 by the exporter
# (sym_float), measured 3e-8 relative on the gradients of a lone Mul (outside these ops).
RTOL_SYMBOLIC = 1e-6
SYMBOLIC_CASES = {  # node after Mul(x, w) -> a, its int64 initializers, the torch twin
    "reflect": (("Pad", ["a", "pads"], {"mode": "reflect"}), {"pads": [0, 0, 2, 0, 0, 3]},
                lambda t: F.pad(t, (2, 3), mode="reflect")),
    "edge": (("Pad", ["a", "pads"], {"mode": "edge"}), {"pads": [0, 1, 2, 0, 0, 3]},
             lambda t: F.pad(F.pad(t, (2, 3), mode="replicate")[None], (0, 0, 1, 0), mode="replicate")[0]),
    "wrap": (("Pad", ["a", "pads"], {"mode": "wrap"}), {"pads": [0, 0, 9, 0, 0, 3]},
             lambda t: torch.cat([t[:, :, -1:], t, t, t[:, :, :3]], 2)),
    "constant-crop": (("Pad", ["a", "pads"], {}), {"pads": [0, -1, 2, 0, 0, -3]}, lambda t: F.pad(t, (2, -3, -1, 0))),
    "slice-negative-step": (("Slice", ["a", "starts", "ends", "axes", "steps"], {}),
                            {"starts": [-1], "ends": [-100], "axes": [2], "steps": [-2]}, lambda t: t.flip(2)[:, :, ::2]),
    "slice-whole-batch": (("Slice", ["a", "starts", "ends", "axes"], {}),
                          {"starts": [0, 1], "ends": [2**63 - 1, 3], "axes": [0, 1]}, lambda t: t[:, 1:3]),
    "flatten": (("Flatten", ["a"], {"axis": -2}), {}, lambda t: t.reshape(t.shape[0], -1)),
}


@pytest.mark.parametrize("name", SYMBOLIC_CASES)
def test_op_at_a_symbolic_batch_trains_like_torch(name):
    (op, inputs, attrs), ints, twin = SYMBOLIC_CASES[name]
    weight = rng.standard_normal((3, 8))
    nodes = [onnx.helper.make_node("Mul", ["x", "w"], ["a"]), onnx.helper.make_node(op, inputs, ["y"], **attrs)]
    graph = onnx.helper.make_graph(
        nodes, name, [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.DOUBLE, ["N", 3, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None)],
        [onnx.numpy_helper.from_array(weight, "w")] + [onnx.numpy_helper.from_array(_ints(*v), k) for k, v in ints.items()])
    model = onnx.shape_inference.infer_shapes(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)]))
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125}, dynamic_batch=True)
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    for batch in (1, 3):
        x = rng.standard_normal((batch, 3, 8))
        batches = [({"x": x}, rng.standard_normal(twin(torch.tensor(x)).shape))]
        want = torch_steps(lambda p, i: twin(p["w"] * i["x"]), {"w": weight}, F.mse_loss, torch.optim.SGD, {"lr": 0.125},
                           batches)
        assert_steps_match(bridge_steps(tm, batches), want, rtol=RTOL_SYMBOLIC)


# -- Every op of importer/ops/{tensor,sequence,indexing}.py behind a trainable weight -----------

X = rng.standard_normal((2, 3, 4, 5))
NODE_CASES = [  # id, op, x, initializers, attributes
    ("reshape", "Reshape", X, {"shape": _ints(0, -1, 5)}, {}),
    ("transpose", "Transpose", X, {}, {"perm": [3, 1, 0, 2]}),
    ("concat", "Concat", X, {"other": rng.standard_normal((2, 1, 4, 5))}, {"axis": 1}),
    ("squeeze", "Squeeze", X[:, :1], {"axes": _ints(1)}, {}),
    ("unsqueeze", "Unsqueeze", X, {"axes": _ints(0, -1)}, {}),
    ("expand", "Expand", X[:, :1], {"shape": _ints(2, 3, 4, 5)}, {}),
    ("tile", "Tile", X, {"repeats": _ints(1, 2, 1, 3)}, {}),
    ("slice", "Slice", X, {"starts": _ints(1, -4), "ends": _ints(3, 2**62), "axes": _ints(1, 3), "steps": _ints(1, 3)}, {}),
    ("slice-negative-steps", "Slice", X, {"starts": _ints(3, 4), "ends": _ints(0, -100), "axes": _ints(2, 3),
                                          "steps": _ints(-2, -3)}, {}),
    ("gather", "Gather", X, {"indices": _ints(2, 0, 2)}, {"axis": 2}),
    ("gather-negative", "Gather", X, {"indices": np.array([[-1, 0], [1, 1]], np.int64)}, {"axis": 1}),
    ("gather-scalar", "Gather", X, {"indices": np.array(1, np.int64)}, {"axis": 1}),
    ("gather-elements", "GatherElements", X, {"indices": rng.integers(-3, 3, (2, 3, 4, 5))}, {"axis": 1}),
    ("gather-nd", "GatherND", X, {"indices": np.array([[0, 1], [1, -1]], np.int64)}, {}),
    ("gather-nd-batch", "GatherND", X, {"indices": np.array([[1, 2], [0, 0]], np.int64)}, {"batch_dims": 1}),
    ("depth-to-space-dcr", "DepthToSpace", rng.standard_normal((2, 8, 2, 3)), {}, {"blocksize": 2}),
    ("depth-to-space-crd", "DepthToSpace", rng.standard_normal((2, 8, 2, 3)), {}, {"blocksize": 2, "mode": "CRD"}),
    ("space-to-depth", "SpaceToDepth", X[:, :, :, :4], {}, {"blocksize": 2}),
    ("trilu", "Trilu", X, {"k": np.array(1, np.int64)}, {"upper": 0}),
    ("identity", "Identity", X, {}, {}),
    ("flatten", "Flatten", X, {}, {"axis": -2}),
    ("pad-constant", "Pad", X, {"pads": _ints(0, 1, 1, 2, 0, 0, 2, -1), "value": np.array(0.5)}, {}),
]


@pytest.mark.parametrize("op, x, inits, attrs", [pytest.param(*c[1:], id=c[0]) for c in NODE_CASES])
def test_op_behind_a_weight_matches_finite_differences(op, x, inits, attrs):
    _check_against_finite_differences(_prescaled(op, x, inits, **attrs), x)


@pytest.mark.parametrize("inits, attrs", [({"split": _ints(1, 2)}, {"axis": 1}), ({}, {"axis": 3, "num_outputs": 2})],
                         ids=["sizes", "num_outputs"])
def test_split_behind_a_weight_matches_finite_differences(inits, attrs):
    """Two outputs; the loss is on the first, so the second part gets no gradient."""
    _check_against_finite_differences(_prescaled("Split", X, inits, outputs=2, **attrs), X)


SEQUENCE_CASES = {
    "split-to-sequence-at": ([
        onnx.helper.make_node("SplitToSequence", ["pre", "split"], ["seq"], axis=3),
        onnx.helper.make_node("SequenceAt", ["seq", "one"], ["y"]),
    ], {"split": _ints(2, 3), "one": np.array(1, np.int64)}),
    "construct-length-concat": ([
        onnx.helper.make_node("SequenceConstruct", ["pre", "pre"], ["seq"]),
        onnx.helper.make_node("SequenceLength", ["seq"], ["count"]),
        onnx.helper.make_node("ConcatFromSequence", ["seq"], ["both"], axis=0),
        onnx.helper.make_node("Reshape", ["both", "count_by_rest"], ["y"]),
    ], {"count_by_rest": _ints(2, -1)}),
    "unit-split-stack": ([
        onnx.helper.make_node("SplitToSequence", ["pre"], ["seq"], axis=1, keepdims=0),
        onnx.helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=-1, new_axis=1),
    ], {}),
}


@pytest.mark.parametrize("name", SEQUENCE_CASES)
def test_sequence_ops_behind_a_weight_match_finite_differences(name):
    nodes, inits = SEQUENCE_CASES[name]
    _check_against_finite_differences(_sequence_model(nodes, X.shape, inits), X)


def test_clip_without_bounds_is_the_identity():
    _check_against_finite_differences(_prescaled("Clip", X, {}), X)
