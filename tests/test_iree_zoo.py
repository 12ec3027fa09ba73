"""IREE compiles real models at its default flags and trains them exactly (issue 14).

Default tier: the minimal repros of the compiler defects bridge's lowerings avoid (a strided,
padded Conv whose padded input has an unread end; max-pool backward with ties) against torch
float64, and one small CNN with both against onnxruntime. Exhaustive tier: every zoo model
(hand-built, text, vision; static and symbolic batch where the model has one) plus torchvision
resnet18 and mobilenet_v3_small at 32x32 and 64x64, batch 8: IREE's first step (loss, every
gradient, every update) matches onnxruntime's at the zoo's tolerance and, for torch modules,
the module's own float64 step as the zoo checks it; where a model's data sits at float32 decisions
(ReLU kinks, max-pool ties) that comparison falls back to each runtime against float64 up to
proven near-decision flips (``zoo.harness.flip_fit``; the zoo test's docstring says what exactly).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, torch_steps
from helpers.single_op import one_node_model
from zoo.compiled import median_step_seconds, torch_case, zoo_params

import bridge
from bridge.tools.compile import FAST_CONV_FLAGS

pytestmark = pytest.mark.iree  # skipped without the bridge[iree] extra (conftest.py)

FLOAT32_RTOL = 1e-5  # float32 steps vs torch float64 on these tiny graphs (measured worst: 3e-7)


# --- minimal repros (default tier) --------------------------------------------------------------

# (input spatial size, kernel, stride, pad): the padded input has an end the windows never read.
# 2x2/k3/s2/p1 is resnet18's first strided Conv at 32x32 after the stem (output 1 wide); 5x5/s3
# reads 6 of 7 padded elements; 4x4/k3/s2/p0 leaves an input element (not only pad) unread.
CONV_GEOMETRIES = {"2x2-k3-s2-p1": (2, 3, 2, 1), "5x5-k3-s3-p1": (5, 3, 3, 1), "4x4-k3-s2-p0": (4, 3, 2, 0)}
DEFAULT_TIER = {"2x2-k3-s2-p1", "constant"}  # the repros; the others are exhaustive (CI budget)


def _tiered(values):
    return [pytest.param(v, marks=[] if v in DEFAULT_TIER else [pytest.mark.exhaustive], id=v) for v in values]


def _float64_steps(tm, twin, weights, batches, loss="mse"):
    """torch float64 steps (SGD, the graph's lr) of ``twin`` from the float32 weights."""
    wide = {k: v.astype(np.float64) for k, v in weights.items()}
    wide_batches = [({k: v.astype(np.float64) for k, v in i.items()}, t.astype(np.float64)) for i, t in batches]
    loss_fn = {"mse": F.mse_loss}[loss]
    return torch_steps(twin, wide, loss_fn, torch.optim.SGD, {"lr": float(tm.initial_state()["lr"])}, wide_batches)


def _iree_steps(tm, batches, extra_args: tuple[str, ...] = ()) -> list[dict]:
    session = bridge.compile(tm, extra_args=extra_args).session(seed=0)
    return [session.step(inputs, target) for inputs, target in batches]


def _steps_match_float64(tm, twin, weights, batches):
    """onnxruntime and IREE steps both match torch float64 at float32 resolution."""
    want = _float64_steps(tm, twin, weights, batches)
    assert_steps_match(bridge_steps(tm, batches), want, rtol=FLOAT32_RTOL)
    assert_steps_match(_iree_steps(tm, batches), want, rtol=FLOAT32_RTOL)


@pytest.mark.parametrize("geometry", _tiered(CONV_GEOMETRIES))
def test_strided_padded_conv_trains_in_iree(geometry):
    """Forward Conv and both backward Convs of the repro geometry compile and are exact."""
    size, k, s, p = CONV_GEOMETRIES[geometry]
    rng = np.random.default_rng(0)
    weights = {"W": rng.standard_normal((3, 2, k, k)).astype(np.float32), "B": rng.standard_normal(3).astype(np.float32)}
    x = rng.standard_normal((2, 2, size, size)).astype(np.float32)
    model = one_node_model("Conv", ["x", "W", "B"], {"x": x}, weights, 17, kernel_shape=[k, k], strides=[s, s],
                           pads=[p] * 4)
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    out = (size + 2 * p - k) // s + 1
    batches = [(x_, rng.standard_normal((2, 3, out, out)).astype(np.float32))
               for x_ in (x, rng.standard_normal(x.shape).astype(np.float32))]
    batches = [({"x": x_}, t) for x_, t in batches]

    def twin(w, i):
        return F.conv2d(i["x"], w["W"], w["B"], stride=s, padding=p)

    _steps_match_float64(tm, twin, weights, batches)


@pytest.mark.parametrize("fill", _tiered(["constant", "coarse"]))
def test_max_pool_ties_route_to_the_first_max_in_iree(fill):
    """y = MaxPool(x * W), 3x3 windows, stride 2, pad 1 (overlapping, as resnet's stem).

    ``constant``: every window is all ties; torch gives each window's gradient to its FIRST
    element only, so W's gradient shows any tie routed elsewhere (or twice). ``coarse``: values
    on a grid of 4 levels (ties in some windows, distinct maxima in others)."""
    rng = np.random.default_rng(1)
    shape = (2, 3, 6, 6)
    x = np.ones(shape, np.float32) if fill == "constant" else rng.integers(0, 4, shape).astype(np.float32)
    weights = {"w_pre": np.ones(shape[1:], np.float32)}
    model = one_node_model("MaxPool", ["x"], {"x": x}, {}, 17, prescale=weights["w_pre"], kernel_shape=[3, 3],
                           strides=[2, 2], pads=[1, 1, 1, 1])
    tm = bridge.to_training_onnx(model, loss="mse", optim="sgd", optim_options={"lr": 0.125})
    batches = [({"x": x}, rng.standard_normal((2, 3, 3, 3)).astype(np.float32)) for _ in range(2)]

    def twin(w, i):
        return F.max_pool2d(i["x"] * w["w_pre"], 3, 2, 1)

    _steps_match_float64(tm, twin, weights, batches)
    assert "ArgMax" not in {n.op_type for n in tm.model.graph.node}


def _small_cnn() -> torch.nn.Module:
    """resnet18's stem and first downsampling at 8x8: both repro patterns in one net."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 7, 2, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(4, 6, 3, 2, 1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(6, 3),
    )


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), FAST_CONV_FLAGS], ids=["default-flags", "fast-conv-flags"])
def test_small_cnn_matches_onnxruntime_in_iree(flags, tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "cnn.onnx")
    torch.onnx.export(_small_cnn().eval(), (torch.randn(2, 3, 8, 8),), path, dynamo=False, input_names=["x"],
                      output_names=["y"])
    tm = bridge.to_training_onnx(path, loss="ce", optim="adam", optim_options={"lr": 0.01})
    rng = np.random.default_rng(0)
    batches = [({"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}, rng.integers(0, 3, 2)) for _ in range(3)]
    assert_steps_match(_iree_steps(tm, batches, flags), bridge_steps(tm, batches))


# --- the zoo (exhaustive tier) ----------------------------------------------------------------


# Models whose IREE compile or first step still fails, and why (strict: a fixed cause turns the
# xfail into a failure, so this list stays true). mobilenet_v3_small@32-static was one until the
# float32 noise allowance counted onnxruntime's measured noise too (``_float32_noise``).
XFAIL: dict[str, str] = {
    # resnet18-static (zoo, batch 2) was one until the Conv backward forms changed: IREE silently
    # miscomputed the graph bridge emitted before (docs/notes/onnx-mlir-iree-investigations.md section 5, cause not found); the
    # GEMM/scatter forms compute right, so a regression to a wrong step fails this test.
    # vgg11_bn-static, mobilenet_v2-dynamic and resnet18d-dynamic were strict xfails until the zoo drew
    # their data where no ReLU kink or max-pool tie within float32 rounding can move a gradient past the
    # tolerance (zoo.harness.safe_attempt, torch_models.DRAWS; docs/notes/onnx-mlir-iree-investigations.md section 7): there IREE
    # and onnxruntime routed one element's gradient differently (resnet18d at batch 3: onnxruntime
    # flipped layer4.0.act2's ReLU input [0, 450, 0, 0], -1.9e-6 in float64; IREE matched float64).
    # densenet121: no draw keeps off ReLU decisions within float32 rounding (DRAWS None), and IREE and
    # onnxruntime round a different few of them; the test falls back to each runtime vs torch float64 up
    # to proven near-decision flips (zoo.harness.flip_fit).
}

# shufflenet_v2_x0_5-dynamic: on its plain batch-3 draw conv5.2's ReLU has one input 3.4e-5 from 0
# (float32 error 2.1e-5), and onnxruntime, not IREE, is off torch float64 there. Its recorded draw
# (torch_models.DRAWS: 14) passes.


def _float32_noise(float64: dict, torch_noise: dict, onnxruntime: dict) -> dict[str, float]:
    """Per key, the larger of torch's and onnxruntime's MEASURED float32 error of the float64 step.

    The zoo allows a float32 runtime ``NOISE_FACTOR`` x the oracle's float32 noise; torch's is one
    float32 implementation's, and on a gradient that is zero in theory (noise only) another
    float32 implementation's differs by more than a constant factor: mobilenet_v3_small@32's
    grad_features.1.block.2.1.bias (a BatchNorm bias whose output feeds a 1x1 Conv and a
    BatchNorm, 5.6e-16 in float64) has torch noise 2.1e-7, onnxruntime's 2.7e-7, IREE's 9.4e-7.
    IREE gets the same factor of the worse of the two measured, never a bigger factor."""
    return {k: max(v, float(np.max(np.abs(onnxruntime[k] - float64[k]))) if float64[k].size else 0.0)
            for k, v in torch_noise.items()}


@pytest.mark.exhaustive
@pytest.mark.parametrize("kind, name, mode", list(zoo_params()))
def test_zoo_model_compiles_and_matches_onnxruntime(kind, name, mode, tmp_path, request):
    """IREE's first step (loss, every gradient, every update) matches onnxruntime's at the zoo's
    tolerance (twice torch's float32 noise) and, for a torch module, the module's own float64 step
    (``NOISE_FACTOR`` x the worse of torch's and onnxruntime's float32 noise).

    Where that fails on a torch module, what is compared instead is each runtime with torch
    float64 up to proven near-decision flips: ``zoo.harness.flip_fit`` must explain IREE's step
    AND onnxruntime's as float64's with at most ``MAX_FITTED_FLIPS`` decisions within float32
    rounding (ReLU inputs at their kink, max-pool windows whose two largest inputs are that close)
    flipped, each fitted coefficient settled at 0 or 1 (``FlipFit.unsettled``), and each runtime's step must match the
    float64 step with its own flips at rtol 1e-4 of the scale + 4x torch's float32 noise on every
    element (loss, gradients, updates, running statistics). The two runtimes may flip different
    decisions, so they are not compared with each other there; a gradient off by anything else
    (a wrong graph, a miscompile) is not explained and fails (tests/test_zoo_decisions.py)."""
    from zoo.handbuilt import CASES
    from zoo.harness import assert_first_step, assert_float64_up_to_flips

    if request.node.callspec.id in XFAIL:
        request.applymarker(pytest.mark.xfail(reason=XFAIL[request.node.callspec.id], strict=True))
    start = time.perf_counter()
    if kind == "handbuilt":
        case = next(b for b in CASES if b.__name__ == name)()
        tm = bridge.to_training_onnx(case.model, loss=case.loss, optim="adam", optim_options={"lr": case.lr},
                                     input_shapes={k: list(v.shape) for k, v in case.inputs.items()})
        expected = None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case, tm, fit = torch_case(kind, name, mode, tmp_path)
        expected = case.oracle()
    convert = time.perf_counter() - start
    try:
        compiled = bridge.compile(tm)
        iree, ort = compiled.session(seed=0), tm.session(seed=0)
        got, want = iree.step(case.inputs, case.target), ort.step(case.inputs, case.target)
        # the zoo's tolerance puts each runtime within rtol of a tensor's scale plus NOISE_FACTOR x
        # torch's own float32 error of float64; two runtimes are within twice that error of each
        # other (gradients zero in theory, e.g. a bias before a BatchNorm, are noise in both)
        noise = {k: 2 * v for k, v in expected[1].items()} if expected is not None else {}
        if expected is not None:  # the zoo's keys; Adam's moments after one step are 0.1 g and 0.001 g^2
            want = {k: want[k] for k in expected[0]}
        try:
            assert_first_step(replace(case, name=f"{case.name} IREE vs onnxruntime"), got, want, noise,
                              tm.initial_state())
            if expected is not None:
                assert_first_step(replace(case, name=f"{case.name} IREE vs torch float64"), got, expected[0],
                                  _float32_noise(*expected, want), tm.initial_state())
        except AssertionError as direct:
            if expected is None:
                raise
            for runtime, step in (("IREE", got), ("onnxruntime", want)):
                assert_float64_up_to_flips(case, runtime, step, fit(step, *expected), expected[1],
                                            tm.initial_state(), direct)
    except (AssertionError, bridge.BridgeError) as exc:  # reported at once: the whole tier runs for hours
        print(f"\nIREE-ZOO FAILED {request.node.callspec.id}: {type(exc).__name__}: {str(exc)[:1500]}")
        raise
    print(f"\nIREE-ZOO {request.node.callspec.id}: convert {convert:.1f} s, compile {compiled.seconds:.1f} s, "
          f"step IREE {median_step_seconds(iree, case.inputs, case.target) * 1e3:.1f} ms, "
          f"onnxruntime {median_step_seconds(ort, case.inputs, case.target) * 1e3:.1f} ms")
