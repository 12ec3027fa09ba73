"""Target forms (bridge/pipeline/targets.py): every target's graph, and the plain graph with any one form
added, computes the same training steps as the plain graph and as torch; the iree and onnx-mlir targets'
graphs compile with their compiler and step as in onnxruntime.

Tolerances are multiples of torch's own float32 noise on the same steps (float32 vs float64 torch, per
output): a form reorders float32 sums at most, so it moves results by about that noise, never by more.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.importer import run_onnxruntime
from helpers.reference import assert_steps_match, bridge_steps, random_batches
from helpers.training import module_steps
from onnx import TensorProto, helper
from torch.fx.experimental.proxy_tensor import make_fx

import bridge
from bridge.errors import InvalidOptionError
from bridge.pipeline import targets
from bridge.pipeline.export.builder import GraphBuilder, Value
from bridge.pipeline.export.ops import elementwise
from bridge.tools.target_check import onnx_mlir_missing

STEPS = 3
# measured: the largest (graph - plain) and (graph - torch float64) error is 2.5x torch's float32 noise
# (the CNN's gradients under onnxruntime's conv backward forms)
NOISE_FACTOR = 4.0
# forms that only move or regroup values: their graph's steps equal the plain graph's bit for bit
EXACT = {"affine_as_batch_norm", "scalar_ranks", "relu_after_maxpool", "constant_matmul_moves", "recompute_from_kept"}
FLOAT32_FLOOR = 2.0 ** -23  # the noise of a result torch computes exactly in both precisions


class CNN(torch.nn.Module):
    """Conv/BatchNorm/ReLU/MaxPool whose shapes make the onnxruntime rules pick every conv form: an RGB
    stem, a large and a mid-size plane, strided and depthwise Convs, 2x2 planes (forward as one MatMul),
    a 1x1 Conv (a ``[C, C, 1, 1]`` weight that the update's scalars broadcast against). No bias before a BatchNorm:
    its gradient is 0 up to rounding, which no relative tolerance judges."""

    def __init__(self):
        super().__init__()
        conv = torch.nn.Conv2d
        self.stem = torch.nn.Sequential(conv(3, 16, 3, padding=1), conv(16, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(2))  # 12x12 -> 6x6
        self.body = torch.nn.Sequential(conv(16, 16, 3, padding=1), conv(16, 16, 3, padding=1, groups=16),
                                        conv(16, 32, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                                        conv(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        conv(64, 64, 3, padding=1), conv(64, 64, 1))  # 6x6 -> 3x3 -> 2x2
        self.fc = torch.nn.Linear(64 * 2 * 2, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.body(self.stem(x)), 1))


class MLP(torch.nn.Module):
    """A Linear from one feature (a ``[8, 1]`` weight, broadcast against the update's scalars), a BatchNorm1d
    (``affine`` on a rank-2 tensor) and a Tanh of its output (values near 0 and far from it)."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8, bias=False),
                                       torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


class Wide(torch.nn.Module):
    """Linears over a batch of 256 rows, one of 128 inputs: weight gradients with a long inner dimension and a
    forward with a short one, the products ``explicit_transposes`` applies to."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 5))

    def forward(self, x):
        return self.net(x)


MODELS = {  # name -> (module class, input shape, loss, torch loss)
    "cnn": (CNN, (4, 3, 12, 12), "ce", F.cross_entropy),
    "mlp": (MLP, (6, 1), "mse", F.mse_loss),
    "wide": (Wide, (256, 64), "ce", F.cross_entropy),
}
FORM_MODEL = {  # the model each form applies to
    "conv_forward_gemm": "cnn", "conv_backward_gemm": "cnn", "constant_matmul_moves": "cnn",
    "relu_after_maxpool": "cnn", "affine_as_batch_norm": "mlp", "scalar_ranks": "mlp", "dense_conv_as_matmul": "cnn",
    "tanh_as_exp": "mlp", "conv_forward_rows": "cnn", "long_inner_gemm": "cnn", "explicit_transposes": "wide",
    "conv_columns_in_parts": "cnn", "recompute_from_kept": "mlp",
}
REQUIRES = {  # form -> the forms without which it has nothing to apply to (its products are dense_conv_as_matmul's)
    "conv_forward_rows": frozenset({"dense_conv_as_matmul"}), "long_inner_gemm": frozenset({"dense_conv_as_matmul"}),
    "conv_columns_in_parts": frozenset({"dense_conv_as_matmul", "conv_forward_rows"}),
}
OPTIONS = {"lr": 0.05, "momentum": 0.9}  # linear in the gradient (Adam's first step, g / (|g| + eps), is not)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (module, path, batches, torch float32 steps, torch float64 steps, plain graph's steps)."""
    built = {}
    for name, (cls, shape, _, torch_loss) in MODELS.items():
        torch.manual_seed(0)
        module = cls()
        path = tmp_path_factory.mktemp("targets") / f"{name}.onnx"
        bridge.export_for_training(module, (torch.randn(*shape),), path)
        plain = _convert(path, name, "plain")
        assert bridge.check(plain.model, target="onnx-mlir", compile=False) == [], "the plain graph is onnx-mlir clean"
        batches = random_batches(plain, STEPS, seed=1, classes=5)
        want32 = []  # torch float32 at one and two threads: its noise is the larger of the two
        threads = torch.get_num_threads()
        for count in (1, 2):
            torch.set_num_threads(count)
            want32.append(module_steps(module, batches, torch_loss, torch.optim.SGD, OPTIONS))
        torch.set_num_threads(threads)
        batches64 = [({k: v.astype(np.float64) for k, v in inputs.items()},
                      target.astype(np.float64) if target.dtype.kind == "f" else target) for inputs, target in batches]
        want64 = module_steps(_double(module), batches64, torch_loss, torch.optim.SGD, OPTIONS)
        built[name] = (module, path, batches, want32, want64, bridge_steps(plain, batches))
    return built


def _double(module: torch.nn.Module) -> torch.nn.Module:
    twin = type(module)()
    twin.load_state_dict(module.state_dict())
    return twin.double()


def _convert(path, name: str, target: str) -> bridge.TrainingModel:
    return bridge.to_training_onnx(str(path), loss=MODELS[name][2], optim="sgd", optim_options=OPTIONS, target=target)


def _error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference, relative to ``want``'s largest magnitude."""
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def _assert_within_noise(got: list[dict], want: list[dict], noise: dict[int, dict[str, float]], what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in noise[step]:
            error, bound = _error(g[key], w[key]), NOISE_FACTOR * noise[step][key]
            assert error <= bound, f"{what}, step {step}: {key} off by {error:.2e} (bound {bound:.2e})"


def _torch_noise(want32: list[list[dict]], want64: list[dict]) -> dict[int, dict[str, float]]:
    """Per step and output: how far torch's float32 steps (each thread count) are from its float64 ones
    (relative)."""
    return {step: {key: max(FLOAT32_FLOOR, *(_error(run[step][key], w64[key]) for run in want32)) for key in w64}
            for step, w64 in enumerate(want64)}


def _check(models, name: str, tm: bridge.TrainingModel, what: str) -> None:
    """``tm``'s steps equal the plain graph's and torch's (float64) within torch's float32 noise."""
    _, _, batches, want32, want64, plain = models[name]
    got = bridge_steps(tm, batches)
    noise = _torch_noise(want32, want64)
    _assert_within_noise(got, want64, noise, f"{what} vs torch")
    _assert_within_noise(got, plain, noise, f"{what} vs the plain graph")


@pytest.mark.parametrize("target", sorted(set(targets.TARGETS) - {"plain"}))
@pytest.mark.parametrize("name", MODELS)
def test_every_target_computes_the_plain_steps(models, name, target):
    _check(models, name, _convert(models[name][1], name, target), f"target {target}")


def test_plain_graph_trains_like_torch(models):
    for name in MODELS:
        _, _, _, want32, want64, plain = models[name]
        _assert_within_noise(plain, want64, _torch_noise(want32, want64), f"{name}, plain vs torch")


@pytest.mark.slow
@pytest.mark.parametrize("form", sorted(targets.FORMS))
def test_each_form_alone_changes_the_graph_not_the_steps(models, monkeypatch, form):
    """The plain target plus ``form`` (and the forms it ``REQUIRES``): a different graph than without it (the
    model exercises the form) with the same steps."""
    name, required = FORM_MODEL[form], REQUIRES.get(form, frozenset())
    monkeypatch.setitem(targets.TARGETS, "only", required | {form})
    monkeypatch.setitem(targets.TARGETS, "without", required)
    tm = _convert(models[name][1], name, "only")
    plain = _convert(models[name][1], name, "without")
    assert _nodes(tm.model) != _nodes(plain.model), f"{form} does not apply to the {name} model"
    _check(models, name, tm, f"form {form}")
    if form in EXACT:
        batches, want = models[name][2], models[name][5]
        for step, (got, plain_step) in enumerate(zip(bridge_steps(tm, batches), want, strict=True)):
            for key, value in plain_step.items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"form {form}, step {step}: {key}")


def _nodes(model) -> list[tuple[str, ...]]:
    return [(node.op_type, *node.input) for node in model.graph.node]


@pytest.mark.slow
@pytest.mark.parametrize("target", [
    pytest.param("iree", marks=pytest.mark.iree),
    pytest.param("onnx-mlir", marks=[pytest.mark.onnx_mlir, pytest.mark.skipif(
        onnx_mlir_missing() is not None, reason="onnx-mlir is not available (ONNX_MLIR_HOME or PATH)")]),
])
@pytest.mark.parametrize("name", MODELS)
def test_compiled_target_graph_steps_as_in_onnxruntime(models, name, target):
    """The compiler's target graph, compiled by that compiler, takes onnxruntime's steps on the same graph."""
    tm = _convert(models[name][1], name, target)
    batches = models[name][2]
    session = bridge.compile(tm, backend=target).session(seed=0)
    assert_steps_match([session.step(inputs, labels) for inputs, labels in batches], bridge_steps(tm, batches))


# the largest growth of a kept Conv input by its padded border: the stem's 12x12 plane padded by 1
PADDED_BORDER = (14 / 12) ** 2


@pytest.mark.parametrize("target", ["iree", "onnx-mlir"])
def test_compiled_target_keeps_no_more_for_the_backward_than_the_plain_graph(models, target):
    """The bytes of forward values that the backward reads (alive from the forward to the backward) in the target's
    graph are the plain graph's, up to a padded border: its im2col forms keep no columns (``K`` times a Conv's
    input) from the forward's product for the weight gradient."""
    def kept_bytes(model: onnx.ModelProto) -> int:
        inferred = onnx.shape_inference.infer_shapes(model)
        sizes = {v.name: math.prod(d.dim_value for d in v.type.tensor_type.shape.dim)
                 * helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).itemsize for v in inferred.graph.value_info}
        producer = {output: node.name for node in model.graph.node for output in node.output}
        kept = {name for node in model.graph.node if node.name.startswith("backward_") for name in node.input
                if producer.get(name, "").startswith("forward_")}
        return sum(sizes[name] for name in kept)

    path = models["cnn"][1]
    assert kept_bytes(_convert(path, "cnn", target).model) <= PADDED_BORDER * kept_bytes(_convert(path, "cnn", "plain").model)


def test_tanh_as_exp_is_tanh_to_float32_rounding():
    """The ``tanh_as_exp`` form, run in onnxruntime, is within ``NOISE_FACTOR`` times torch float32 tanh's own error
    (in float32 rounding units of the float64 value; torch's is half a unit) on both sides of its polynomial's bound, where exp overflows, and at
    the infinities; NaN stays NaN."""
    bound = elementwise.TANH_TAYLOR_BELOW
    grid = np.concatenate([np.linspace(-20, 20, 400_001), np.geomspace(1e-30, 20, 100_000), [bound, np.nextafter(bound, 0)]])
    x = np.concatenate([grid, -grid, [np.inf, -np.inf, np.nan]]).astype(np.float32)
    node = next(n for n in make_fx(torch.tanh)(torch.zeros(2)).graph.nodes if n.target is torch.ops.aten.tanh.default)
    builder = GraphBuilder()
    with targets.using("onnx-mlir"):
        y = elementwise.emit_tanh(builder, node, Value("x", x.shape, torch.float32))
    graph = helper.make_graph(builder.nodes, "tanh", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info(str(y), TensorProto.FLOAT, x.shape)])
    builder.write_initializers(graph)
    assert "Tanh" not in {n.op_type for n in graph.node}
    got = run_onnxruntime(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), {"x": x})[0]
    want = np.tanh(x.astype(np.float64))
    unit = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    finite = np.isfinite(x)
    torch_error = np.max(np.abs(torch.tanh(torch.from_numpy(x[finite])).numpy() - want[finite]) / unit[finite])
    error = np.abs(got[finite] - want[finite]) / unit[finite]
    assert error.max() <= NOISE_FACTOR * torch_error, f"{error.max():.2f} units at x = {x[finite][error.argmax()]!r}"
    np.testing.assert_array_equal(got[~finite], [1, -1, np.nan])


def test_every_form_has_a_model():
    assert set(FORM_MODEL) == set(targets.FORMS)


def test_unknown_target_is_refused(models):
    with pytest.raises(InvalidOptionError, match="target='tensorrt'.*onnxruntime"):
        _convert(models["mlp"][1], "mlp", "tensorrt")


def test_cli_convert_takes_a_target(models, tmp_path):
    from bridge.cli import main

    out, path = tmp_path / "plain.onnx", models["mlp"][1]
    assert main(["convert", str(path), "--optim", "sgd", "--optim-options", '{"momentum": 0.9}', "--target", "plain", "-o", str(out)]) == 0
    written = _nodes(onnx.load(str(out)))
    assert written == _nodes(_convert(path, "mlp", "plain").model) != _nodes(_convert(path, "mlp", "onnxruntime").model)
