"""What every zoo test checks, and the eager-torch oracle for torch modules.

``check_case`` converts a model with a loss and Adam, asserts the trained set, compares the
first step (loss, every gradient, every updated weight and running statistic) with the
oracle's, then steps on the same batch and asserts that the loss falls by 10% within 30 steps
(at least 3: the updated state is fed back twice; measured, every CI zoo case gets there in 1-4
steps but conv_transpose, 15; the 30-step curve cost efficientnet_b0 ~12 s of CPU). A model
exported with a symbolic batch (``Case.batches``) is converted once and its first step also
compared with the oracle's at each of those batch sizes (one export and one conversion serve
both the static and the dynamic checks).
``module_oracle`` is the oracle for a torch module: real ``torch.optim.Adam`` on the module
itself (train mode, dropout off), its tensors mapped to ONNX initializer names by value.

Data off decisions that matter: at a ReLU input within float32 rounding of its kink, or a max-pool
window whose two largest inputs are that close, the gradient is set by rounding, not by the model,
and two float32 runtimes (or one and float64) may route it differently; behind BatchNorms with a
few values per channel one such element moves every upstream gradient by percents. So
``near_decisions`` finds those elements (float64 vs float32 forward) and computes each flip's exact
float64 effect on every gradient (``_flip_effects``); ``safe_attempt`` takes the first draw of the
data whose flips cannot move any gradient past the tolerance, and ``torch_models.DRAWS`` records it
per model and batch size so that no run searches (an exhaustive test recomputes it).
docs/notes/onnx-mlir-iree-investigations.md section 7 has the measurements behind it.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from helpers.reference import tolerance_to_scale, torch_steps
from onnx import numpy_helper
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from bridge.tools.verify import scale_of

LOSS_STEPS = 30  # the most steps the loss may take to fall by LOSS_FALL
MIN_STEPS = 3
LOSS_FALL = 0.9
NOISE = 1e-8  # absolute floor: gradients that are exactly zero in theory (e.g. attention key biases)
NOISE_FACTOR = 4  # bridge (float32) may be this many times further from float64 than torch's float32 is
# Where a model allows some elements to miss the tolerance (Case.allowed_mismatch), those may still be
# at most this fraction of the tensor's largest element away: twice the worst measured (densenet121's
# denseblock2.denselayer9.norm1.bias gradient, 7.35%; googlenet 5.05%; see tests/test_zoo_vision.py).
MISMATCH_BOUND = 0.15
# Draws of a torch module's float data tried before giving up (``safe_attempt``): attempt 0 is the
# zoo's plain draw.
DRAW_ATTEMPTS = 20
# A decision flip matters where it can move a gradient past this fraction of its scale: the vision
# zoo's rtol (the rest of its tolerance, NOISE_FACTOR x float32 noise, is the runtimes' rounding).
DECISION_RTOL = 1e-4
# Elements of one decision call whose flips are computed (one partial float64 backward each); a call
# with more counts as mattering.
MAX_FLIPS = 64
# ``flip_fit``: the most decisions a runtime's step may have flipped to count as explained (googlenet's
# onnxruntime step at batch 16, the most measured, flipped 10), how far from 0 or 1 a fitted flip's
# coefficient may be (unless that fraction of the flip moves no gradient element past its tolerance:
# then the fit cannot resolve it and the residual check decides), and the least effect (fraction of
# the tolerance, on some gradient element) a flip must have to be fitted at all (below it its
# coefficient is not determined; the residual check still sees it).
MAX_FITTED_FLIPS = 16
FLIP_ROUNDING = 0.1
FLIP_VISIBLE = 0.1
# gradient elements per tensor in the fit's least squares: this many drawn, plus the ones furthest off
FIT_SAMPLE, FIT_WORST = 256, 32


def torch_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The torch loss bridge's named loss means (cross entropy over [N, T, V] per token)."""
    if name == "mse":
        return F.mse_loss

    def cross_entropy(output, target):
        if output.dim() == 3:
            return F.cross_entropy(output.flatten(0, 1), target.flatten())
        return F.cross_entropy(output, target)

    return cross_entropy


@dataclass
class Case:
    """One zoo model, ready to check: the model, a fixed batch and its oracle."""

    name: str
    model: onnx.ModelProto | str
    inputs: dict[str, np.ndarray]
    target: np.ndarray
    loss: str
    trainable: set[str]  # ONNX initializer names a torch user would train
    # first-step record (loss, grad_*, updated_*) and the oracle's own float32 error per key
    oracle: Callable[[], tuple[dict[str, np.ndarray], dict[str, float]]]
    lr: float = 1e-3
    rtol: float = 1e-5
    # fraction of a tensor's elements that may miss the tolerance (documented per model)
    allowed_mismatch: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    # further batch sizes of a symbolic-batch export, the oracle at another batch (inputs, target)
    batches: tuple[int, ...] = ()
    rebatch: Callable[[dict[str, np.ndarray], np.ndarray], Callable] | None = None
    # per batch among ``batches``, the draw of its rows (``rows``' attempt; absent: 0): the first whose
    # decisions no float32 rounding flip can move past the tolerance (``safe_attempt``, torch_models.DRAWS)
    draws: dict[int, int] = field(default_factory=dict)
    # a torch module's case: ``flip_fit`` of a first step given (inputs, target, got, want, noise);
    # ``assert_step_or_flips`` falls back to it where the direct comparison fails
    explain: Callable[..., FlipFit] | None = None


def check_case(case: Case) -> dict[str, float]:
    """Run every zoo check on ``case``; returns timings (convert, first step, loss curve)."""
    start = time.perf_counter()
    shapes = {name: list(value.shape) for name, value in case.inputs.items()}
    tm = bridge.to_training_onnx(case.model, loss=case.loss, optim="adam", optim_options={"lr": case.lr},
                                 input_shapes=shapes)
    convert = time.perf_counter() - start
    assert_onnx_mlir_clean(tm, case.name)
    assert set(tm.weights) == case.trainable, (
        f"{case.name}: trained but not a torch parameter: {sorted(set(tm.weights) - case.trainable)}; "
        f"torch parameter not trained: {sorted(case.trainable - set(tm.weights))}"
    )
    session = tm.session()
    first = session.step(case.inputs, case.target)
    want, noise = case.oracle()
    assert_step_or_flips(case, first, want, noise, tm.initial_state())
    assert_loss_falls(case, session, float(first["loss"]))
    if case.batches:
        assert_symbolic_batch(tm, case)
    for batch in case.batches:
        check_batch(case, tm, batch)
    case.timings.update(convert=convert, total=time.perf_counter() - start)
    return case.timings


def assert_loss_falls(case: Case, session, first: float) -> list[float]:
    """Step ``session`` on the case's batch until its loss is below ``LOSS_FALL`` x ``first`` (the
    loss before the first update), at least ``MIN_STEPS`` and at most ``LOSS_STEPS`` steps in all;
    returns the losses."""
    losses = [first]
    while len(losses) < LOSS_STEPS and (len(losses) < MIN_STEPS or losses[-1] >= LOSS_FALL * first):
        losses.append(float(session.step(case.inputs, case.target)["loss"]))
    assert losses[-1] < LOSS_FALL * first, (
        f"{case.name}: loss did not fall by {1 - LOSS_FALL:.0%} in {LOSS_STEPS} steps: {losses}")
    return losses


def rows(array: np.ndarray, batch: int, attempt: int = 0) -> np.ndarray:
    """A batch of ``batch`` rows like ``array``: fresh normal samples for float data (seeded by
    ``batch``, and ``attempt`` after the first), rows taken cyclically for integer data (keeps
    token ids, masks and labels valid)."""
    if array.dtype.kind == "f":
        rng = np.random.default_rng(batch if attempt == 0 else (batch, attempt))
        return rng.standard_normal((batch, *array.shape[1:])).astype(array.dtype)
    return np.take(array, np.arange(batch) % array.shape[0], axis=0)


def batch_rows(inputs: dict[str, np.ndarray], target: np.ndarray, batch: int,
               attempt: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs, target) of ``batch`` rows: ``rows`` of each (float data drawn with ``attempt``)."""
    return {k: rows(v, batch, attempt) for k, v in inputs.items()}, rows(target, batch)


def assert_symbolic_batch(tm: bridge.TrainingModel, case: Case) -> None:
    """Every data input and the target of ``tm`` keep the export's symbolic batch dim."""
    dims = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in tm.model.graph.input
            if i.name in [*case.inputs, "target"]}
    assert set(dims.values()) == {"batch"}, f"{case.name}: batch dims {dims}"


def check_batch(case: Case, tm: bridge.TrainingModel, batch: int) -> None:
    """The first step of ``tm`` (converted once) at ``batch`` rows matches the oracle's at that batch."""
    inputs, target = batch_rows(case.inputs, case.target, batch, case.draws.get(batch, 0))
    got = tm.session().step(inputs, target)
    want, noise = case.rebatch(inputs, target)()
    at_batch = replace(case, name=f"{case.name}@batch{batch}", inputs=inputs, target=target)
    assert_step_or_flips(at_batch, got, want, noise, tm.initial_state())


def assert_step_or_flips(case: Case, got: dict, want: dict, noise: dict, initial: dict) -> None:
    """``assert_first_step``; where that fails for a torch module's case, ``got`` must be torch
    float64's step up to near-decision flips (``case.explain``, ``assert_float64_up_to_flips``)."""
    try:
        assert_first_step(case, got, want, noise, initial)
    except AssertionError as direct:
        if case.explain is None:
            raise
        fit = case.explain(case.inputs, case.target, got, want, noise)
        assert_float64_up_to_flips(case, "onnxruntime", got, fit, noise, initial, direct)


def assert_float64_up_to_flips(case: Case, runtime: str, got: dict, fit: FlipFit, noise: dict, initial: dict,
                               direct: AssertionError) -> None:
    """``got`` is torch float64's first step with at most ``MAX_FITTED_FLIPS`` near decisions flipped
    (``FlipFit.explains``), and matches that flipped step (loss, every gradient, every update and
    running statistic) at rtol ``DECISION_RTOL`` + ``NOISE_FACTOR`` x torch's float32 noise, no
    element allowed to miss; else the ``direct`` comparison's failure stands."""
    print(f"\nFLIP-FIT {case.name}: {runtime} vs torch float64 up to near-decision flips: {fit}")
    assert fit.explains, f"{direct}\n{runtime} is not torch float64's step up to near-decision flips: {fit}"
    assert_first_step(replace(case, name=f"{case.name} {runtime} vs float64 with its flips", rtol=DECISION_RTOL,
                              allowed_mismatch=0.0), got, fit.record, noise, initial)


def assert_onnx_mlir_clean(tm: bridge.TrainingModel, name: str) -> None:
    """No violation of onnx-mlir's op table, except the source model's own forward Casts (HF
    attention masks cast int64 -> float/bool; the table allows Cast between float types only)."""
    phases = {n.name: {p.key: p.value for p in n.metadata_props}.get("bridge.phase") for n in tm.model.graph.node}
    added = [v for v in bridge.check(tm.model, target="onnx-mlir", compile=False) if not (v.op == "Cast" and phases.get(v.node) == "forward")]
    assert added == [], f"{name}: onnx-mlir violations: {added}"


def assert_first_step(case: Case, got: dict, want: dict, noise: dict, initial: dict) -> None:
    """Loss, gradients and running statistics match the oracle within ``rtol`` of each tensor's
    scale plus ``NOISE_FACTOR`` times the oracle's own float32 error; so do updated weights,
    except where the oracle's gradient is within that tolerance of zero: Adam's first step
    moves by ``lr * g / (|g| + eps)``, which turns noise into any value in [-lr, lr], so there
    only the bound is checked."""
    tolerances = {}
    for key, expected in want.items():
        assert key in got, f"{case.name}: output {key} missing"
        tolerances[key] = tolerance(case.rtol, expected, noise.get(key, 0.0))
    for key, expected in want.items():
        actual = got[key]
        grad_key = "grad_" + key[len("updated_"):]
        if key.startswith("updated_") and grad_key in want:
            noisy = np.abs(want[grad_key]) <= 10 * tolerances[grad_key]
            step = np.abs(actual - initial[key[len("updated_"):]])
            assert np.all(step[noisy] <= case.lr * 1.001), f"{case.name}: {key} moved more than lr"
            actual, expected = np.where(noisy, 0, actual), np.where(noisy, 0, expected)
        assert np.all(np.isfinite(actual)), f"{case.name}: {key} has non-finite elements"
        if case.allowed_mismatch:
            error = np.abs(actual - expected)
            off = ~(error <= tolerances[key] + case.rtol * np.abs(expected))
            assert off.mean() <= case.allowed_mismatch, f"{case.name}: {key}: {off.mean():.2%} of elements mismatch"
            scale = scale_of(expected)
            assert not off.any() or error[off].max() <= MISMATCH_BOUND * scale, (
                f"{case.name}: {key}: a mismatching element is {error[off].max() / scale:.2%} of the tensor's scale away")
        else:
            np.testing.assert_allclose(actual, expected, rtol=case.rtol, atol=tolerances[key], equal_nan=False,
                                       err_msg=f"{case.name}: first step, {key}")


def tolerance(rtol: float, expected: np.ndarray, noise: float) -> float:
    """The absolute error allowed on ``expected``: ``rtol`` of its scale, the floor ``NOISE``, and
    ``NOISE_FACTOR`` times the oracle's own float32 error ``noise`` on it."""
    return tolerance_to_scale(rtol, expected, NOISE + NOISE_FACTOR * noise)


def twin_oracle(twin, weights: dict[str, np.ndarray], inputs, target, loss: str, lr: float):
    """First step of an independent torch twin ``twin(params, inputs)`` under real Adam."""
    def oracle():
        return torch_steps(twin, weights, torch_loss(loss), torch.optim.Adam, {"lr": lr}, [(inputs, target)])[0], {}

    return oracle


# --- torch modules -------------------------------------------------------------------------

def perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every float parameter and running statistic distinct values (deterministically).

    Freshly initialised models have many equal tensors (zero biases, unit norm scales) that
    the legacy exporter de-duplicates into one initializer; a trained model has none.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if name.endswith("running_var"):
                tensor.mul_(torch.exp(0.2 * noise))
            else:
                tensor.add_(0.05 * noise)
    return module


def dropout_off(module: torch.nn.Module) -> torch.nn.Module:
    """Turn off random regularisers (dropout, stochastic depth / drop path), in place."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) or type(sub).__name__ == "StochasticDepth":
            sub.p = 0.0
        for attr in ("drop_rate", "drop_prob"):
            if isinstance(getattr(sub, attr, None), float):
                setattr(sub, attr, 0.0)
    return module


def onnx_initializers(model: onnx.ModelProto | str) -> dict[str, np.ndarray]:
    proto = onnx.load(model) if isinstance(model, str) else model
    return {init.name: numpy_helper.to_array(init) for init in proto.graph.initializer}


def name_map(module: torch.nn.Module, model: onnx.ModelProto | str) -> tuple[dict[str, tuple[str, bool]], list[str]]:
    """ONNX initializer name -> (torch name, stored transposed) for the module's float tensors.

    Matched by value (the same name is preferred): exporters rename weights they fold
    (``onnx::MatMul_123`` holding ``W.T``). Returns the map and the torch parameters that
    have no initializer.
    """
    inits = onnx_initializers(model)
    mapping: dict[str, tuple[str, bool]] = {}
    missing = []
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    params = {n for n, _ in module.named_parameters()}
    for tname, tensor in named:
        value = tensor.detach().numpy()
        found = None
        for transposed in (False, True):
            target = value.T if transposed else value
            hits = [o for o, a in inits.items() if a.shape == target.shape and a.dtype == target.dtype
                    and o not in mapping and np.array_equal(a, target)]
            if hits:
                found = (next((o for o in hits if o == tname or o.endswith("." + tname)), hits[0]), transposed)
                break
            if value.ndim != 2:
                break
        if found:
            mapping[found[0]] = (tname, found[1])
        elif tname in params:
            missing.append(tname)
    return mapping, missing


def _torch_args(inputs: dict[str, np.ndarray], dtype) -> list[torch.Tensor]:
    """A module's forward arguments: float inputs in ``dtype``, the others as they are."""
    return [torch.from_numpy(v).to(dtype) if v.dtype.kind == "f" else torch.from_numpy(v) for v in inputs.values()]


def _module_step(module: torch.nn.Module, mapping, inputs, target, loss: str, lr: float, dtype) -> dict[str, np.ndarray]:
    model = dropout_off(copy.deepcopy(module)).train().to(dtype)
    params = dict(model.named_parameters())
    tensors = {**dict(model.named_buffers()), **params}
    opt = torch.optim.Adam(params.values(), lr=lr)
    value = torch_loss(loss)(model(*_torch_args(inputs, dtype)), torch.from_numpy(target))
    value.backward()
    record = {"loss": value.detach().numpy()}
    for onnx_name, (tname, transposed) in mapping.items():
        if tname in params:
            grad = params[tname].grad.numpy()
            record[f"grad_{onnx_name}"] = grad.T if transposed else grad.copy()
    opt.step()
    for onnx_name, (tname, transposed) in mapping.items():
        value = tensors[tname].detach().numpy()
        record[f"updated_{onnx_name}"] = value.T if transposed else value.copy()
    return record


def module_oracle(module: torch.nn.Module, mapping, inputs: dict[str, np.ndarray], target: np.ndarray,
                  loss: str, lr: float):
    """First training step of ``module`` itself under real Adam, keyed by ONNX names.

    Run in float64 (the expected values) and float32: the float32 run's distance from float64
    is torch's own rounding noise on this model, which bounds what float32 bridge can match
    (deep BatchNorm nets at small sizes, biases whose gradient is zero in theory).
    """
    def oracle():
        want = _module_step(module, mapping, inputs, target, loss, lr, torch.float64)
        single = _module_step(module, mapping, inputs, target, loss, lr, torch.float32)
        noise = {k: float(np.max(np.abs(single[k] - want[k]))) if want[k].size else 0.0 for k in want}
        return want, noise

    return oracle


# --- decisions: activation kinks and max-pool ties -------------------------------------------

_aten = torch.ops.aten
# Kinked elementwise ops (functional calls and modules alike, e.g. ReLU6 is a Hardtanh(0, 6)):
# the op's kinks, given its arguments after the input.
KINKS: dict = {
    **{op: lambda *_, **__: (0.0,) for op in (_aten.relu, _aten.relu_, _aten.leaky_relu, _aten.leaky_relu_)},
    **{op: lambda min_val=-1.0, max_val=1.0, *_, **__: (min_val, max_val) for op in (_aten.hardtanh, _aten.hardtanh_)},
    **{op: lambda *_, **__: (-3.0, 3.0) for op in (_aten.hardswish, _aten.hardswish_, _aten.hardsigmoid,
                                                  _aten.hardsigmoid_)},
    **{op: lambda min=None, max=None, *_, **__: tuple(k for k in (min, max) if isinstance(k, (int, float)))
       for op in (_aten.clamp, _aten.clamp_)},
    _aten.clamp_min: lambda min, *_, **__: (min,) if isinstance(min, (int, float)) else (),
    _aten.clamp_max: lambda max, *_, **__: (max,) if isinstance(max, (int, float)) else (),
}
# max_pool1d/2d (modules and functional calls: max_pool1d dispatches to the 2d op)
MAX_POOLS = (_aten.max_pool2d, _aten.max_pool2d_with_indices)


def _pair(value) -> tuple[int, int]:
    value = [value] if isinstance(value, int) else list(value)
    return (value[0], value[-1])


def _window_top2(x: torch.Tensor, out: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1,
                 ceil_mode=False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per max-pool window (of ``out``'s size): its largest input minus its second largest, and
    the flat indices into ``x`` of those two inputs (a 1-element window: gap inf, both -1)."""
    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel_size), _pair(padding), _pair(dilation)
    sh, sw = _pair(stride) if len(stride or ()) else (kh, kw)
    if kh * kw < 2:
        none = torch.full(out.shape, -1, dtype=torch.long)
        return torch.full(out.shape, torch.inf, dtype=x.dtype), none, none
    planes = x.detach().reshape(-1, 1, *x.shape[-2:])
    index = torch.arange(x.numel(), dtype=torch.float64).reshape(planes.shape)

    def unfold(tensor, fill):  # ceil_mode's last window may pass the end: pad one stride more
        padded = F.pad(tensor, (pw, pw + sw, ph, ph + sh), value=fill)
        height, width = ((padded.shape[2 + i] - d * (k - 1) - 1) // s + 1 for i, k, s, d in ((0, kh, sh, dh), (1, kw, sw, dw)))
        windows = F.unfold(padded, (kh, kw), dilation=(dh, dw), stride=(sh, sw)).reshape(len(planes), kh * kw, height, width)
        return windows[:, :, :out.shape[-2], :out.shape[-1]]

    top = unfold(planes, -torch.inf).topk(2, dim=1)
    where = unfold(index, -1.0).gather(1, top.indices).long()
    return ((top.values[:, 0] - top.values[:, 1]).reshape(out.shape), where[:, 0].reshape(out.shape),
            where[:, 1].reshape(out.shape))


def window_gaps(x: torch.Tensor, out: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1,
                ceil_mode=False) -> torch.Tensor:
    """Per max-pool window (of ``out``'s size), its largest input minus its second largest."""
    return _window_top2(x, out, kernel_size, stride, padding, dilation, ceil_mode)[0]


@dataclass
class _Call:
    """One decision op call of a forward: where (module and op), and in the float64 forward the
    elements within ``NOISE_FACTOR`` x float32 error of a decision (``flips``: per element the
    flat indices of the op's input whose cotangent a flip changes, the signed fraction of the
    output's cotangent each gains, and the output's flat index; ``_margins``), the closest distance, the error, and (linked by ``_Link``) the
    op's input and output in the autograd graph."""

    where: str
    input: torch.Tensor
    pointer: int
    count: int = 0
    closest: float = torch.inf
    error: float = 0.0
    flips: list[tuple[tuple[int, ...], tuple[float, ...], int]] = field(default_factory=list)
    link: tuple[torch.Tensor, torch.Tensor, int] | None = None
    effect: float = torch.inf


def _slope_jump(func, args, kwargs, kink: float, above: bool) -> float:
    """How much ``func``'s derivative changes when an input just ``above`` (else below) ``kink``
    crosses it: the other side's slope minus this side's, by float64 differences at the kink
    (exact for piecewise-linear kinks: ReLU -1 above, +1 below; max(0, x) at 6: +1 above)."""
    step = 1e-6 * max(1.0, abs(kink))
    probe = torch.tensor([kink - 2 * step, kink - step, kink + step, kink + 2 * step], dtype=torch.float64)
    values = func(probe, *args[1:], **kwargs)
    below_slope, above_slope = float(values[1] - values[0]) / step, float(values[3] - values[2]) / step
    return below_slope - above_slope if above else above_slope - below_slope


def _margins(func, args, kwargs) -> tuple[torch.Tensor, Callable] | None:
    """Each element's distance from the decision ``func`` takes on it, and per element its flip
    (None: ``func`` takes no decision): (input indices, the signed fraction of the output's
    cotangent each of them gains, output index). A kink flip adds or drops the output's cotangent
    at that element times the derivative's jump there (``_slope_jump``: ReLU, ReLU6, clamp 1,
    LeakyReLU 1 - slope, Hardswish 1/2, Hardsigmoid 1/6); a max-pool tie flip moves the window's
    cotangent from its largest input to the runner-up."""
    packet = func.overloadpacket
    if packet in KINKS:
        kinks = KINKS[packet](*args[1:], **kwargs)
        if not kinks:
            return None
        margins, nearest = torch.stack([(args[0] - k).abs() for k in kinks]).min(0)

        def kink_flip(flat: int):
            kink = kinks[int(nearest.flatten()[flat])]
            return (flat,), (_slope_jump(func, args, kwargs, kink, float(args[0].flatten()[flat]) > kink),), flat

        return margins, kink_flip
    if packet in MAX_POOLS:
        out = func(*args, **kwargs)
        gaps, first, second = _window_top2(args[0], out[0] if isinstance(out, tuple) else out, *args[1:], **kwargs)
        return gaps, lambda flat: ((int(first.flatten()[flat]), int(second.flatten()[flat])), (-1.0, 1.0), flat)
    return None


class _Decisions(TorchDispatchMode):
    """Records every decision op (``KINKS``, ``MAX_POOLS``) call in call order, with the
    innermost module running it and its input; given ``single`` (the same forward's calls in
    float32), measures each one's margins against that input's float32 error instead."""

    def __init__(self, single: list[_Call] | None = None):
        super().__init__()
        self.single, self.stack, self.calls = single, [""], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in KINKS or func.overloadpacket in MAX_POOLS:
            call = _Call(f"{self.stack[-1]} ({func.overloadpacket.__name__})", args[0].detach().clone(),
                         args[0].data_ptr())
            if self.single is not None:
                self._near(call, func, args, kwargs)
            self.calls.append(call)
        return func(*args, **kwargs)

    def _near(self, call: _Call, func, args, kwargs) -> None:
        single = self.single[len(self.calls)]
        assert single.where == call.where, f"float32 and float64 forwards differ: {single.where} vs {call.where}"
        found = _margins(func, args, kwargs)
        if found is None or not found[0].numel():
            return
        margins, flip = found
        call.error = float((single.input.double() - args[0]).pow(2).mean().sqrt())
        margins = torch.where(margins > 0, margins, torch.inf)  # exact ties (ReLU zeros in a window) go the same way in any runtime
        near = (margins < NOISE_FACTOR * call.error).flatten().nonzero().flatten()
        call.count, call.closest = len(near), float(margins.min())
        call.flips = [flip(int(flat)) for flat in near[:MAX_FLIPS]]


class _Link(TorchFunctionMode):
    """Links each decision op call to its input and output tensors in the autograd graph: the
    function call (``F.relu``, ``F.max_pool2d``, ...) that ran it, with in-place calls made
    out-of-place so that its input stays in the graph. A call it cannot link (another in-place
    form, or a decision op inside a larger function) keeps no link: its flips count as mattering."""

    def __init__(self, decisions: _Decisions):
        super().__init__()
        self.decisions = decisions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("inplace") is True:
            kwargs["inplace"] = False
        before = len(self.decisions.calls)
        out = func(*args, **kwargs)
        new, first = self.decisions.calls[before:], args[0] if args else None
        if (len(new) == 1 and isinstance(first, torch.Tensor) and isinstance(out, torch.Tensor)
                and first.data_ptr() == new[0].pointer != out.data_ptr()):
            new[0].link = (first, out, first._version)
        return out


def _forward(module: torch.nn.Module, inputs: dict[str, np.ndarray], dtype, single=None, grad: bool = False):
    """One training-mode forward of a copy of ``module`` in ``dtype`` under ``_Decisions`` and
    ``_Link``: (the copy, its output, the decision calls)."""
    model = dropout_off(copy.deepcopy(module)).train().to(dtype)
    names = {id(m): n for n, m in model.named_modules()}
    mode = _Decisions(single)

    def enter(sub, _):
        mode.stack.append(names.get(id(sub), type(sub).__name__))

    def leave(*_):
        mode.stack.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        with torch.set_grad_enabled(grad), _Link(mode), mode:
            out = model(*_torch_args(inputs, dtype))
    finally:
        for hook in hooks:
            hook.remove()
    return model, out, mode.calls


def _linked(near: list[_Call]) -> list[_Call]:
    """The near calls whose flips can be computed: linked, input not changed in place since, at
    most ``MAX_FLIPS`` near elements."""
    return [c for c in near if c.link and c.count <= MAX_FLIPS and c.link[0]._version == c.link[2]]


Flip = tuple[tuple[int, ...], tuple[float, ...], int]  # one of ``_Call.flips``


def _flip_change(call: _Call, cotangent: torch.Tensor, flip: Flip) -> torch.Tensor:
    """A scalar whose float64 gradient with respect to the parameters is the exact change of their
    gradients if ``flip`` (one of ``call.flips``) went the other way: the backward is linear in the
    cotangent, so that is the backward of the cotangent change at the call's input alone."""
    inputs, fractions, output = flip
    change = torch.zeros_like(call.link[0]).flatten()
    change[list(inputs)] = cotangent.flatten()[output] * torch.tensor(fractions, dtype=change.dtype)
    return (change.reshape(call.link[0].shape) * call.link[0]).sum()


def _flip_effects(model: torch.nn.Module, out: torch.Tensor, target: np.ndarray, loss: str, calls: list[_Call],
                  limit: float = torch.inf) -> None:
    """Set each near call's ``effect``: the most any parameter gradient can move if its near
    elements flip (each flip's exact float64 change of every gradient, summed in absolute value
    over the call's elements), as a fraction of that gradient's zoo tolerance ``DECISION_RTOL``
    x its scale + ``NOISE``. The backward is linear in the cotangent, so a flip changes the
    gradients by the backward of its cotangent change alone (one partial backward per flip; a
    vmapped backward of the stacked changes measured no faster on CPU). inf: the call is not
    linked, its input changed in place later, or more than ``MAX_FLIPS`` elements are near.
    Calls go in forward order (the shortest backwards first) and stop once their effects sum to
    ``limit``: the calls left keep inf (every call does, with no backward, where one is inf)."""
    params = [p for p in model.parameters() if p.requires_grad]
    near = [c for c in calls if c.count]
    linked = _linked(near)
    if len(linked) < len(near) and limit < torch.inf:
        return
    value = torch_loss(loss)(out, torch.from_numpy(target))
    grads = torch.autograd.grad(value, [*params, *(c.link[1] for c in linked)], retain_graph=True, allow_unused=True)
    allowed = [DECISION_RTOL * float(g.abs().max()) + NOISE if g is not None else NOISE for g in grads[:len(params)]]
    total = 0.0
    for call, cotangent in zip(linked, grads[len(params):], strict=True):
        bound = [torch.zeros_like(p) for p in params]
        for flip in call.flips if cotangent is not None else ():
            moved = torch.autograd.grad(_flip_change(call, cotangent, flip), params, retain_graph=True,
                                        allow_unused=True)
            bound = [b + m.abs() if m is not None else b for b, m in zip(bound, moved, strict=True)]
        call.effect = max(float(b.max()) / a for b, a in zip(bound, allowed, strict=True))
        total += call.effect
        if total >= limit:
            return


def near_decisions(module: torch.nn.Module, inputs: dict[str, np.ndarray], target: np.ndarray | None = None,
                   loss: str = "ce", limit: float = torch.inf) -> list[tuple[str, int, float, float, float]]:
    """Where ``module``'s float64 training-mode forward on ``inputs`` is at a decision: for each
    kinked activation (``KINKS``) and max pool (``MAX_POOLS``) call, (module and op, elements
    closer to a kink, or windows whose two largest inputs are closer to each other, than
    ``NOISE_FACTOR`` x that input's float32 error, the smallest such distance, the error, the
    flips' effect), listing only calls with such elements. The float32 error is measured: the
    RMS of |float32 - float64| over the input tensor in the same forward in float32. The effect
    (given the ``target`` of ``loss``; else inf) is the most those elements' flips can move a
    parameter gradient, as a fraction of the zoo's tolerance on it (``_flip_effects``); given a
    ``limit``, effects are computed only until they sum to it (the calls left: inf).

    There the gradient is not defined by the model, only by rounding: a float32 runtime may
    route it to either side, so comparing two of them (or one with float64) tests luck, where
    the flip moves a gradient past the tolerance (effect >= 1)."""
    _, _, single = _forward(module, inputs, torch.float32)
    model, out, wide = _forward(module, inputs, torch.float64, single, grad=target is not None)
    assert len(wide) == len(single), f"float32 and float64 forwards differ: {len(single)} vs {len(wide)} decisions"
    if target is not None and any(c.count for c in wide):
        _flip_effects(model, out, target, loss, wide, limit)
    return [(c.where, c.count, c.closest, c.error, c.effect) for c in wide if c.count]


def flip_effect(found: list[tuple[str, int, float, float, float]]) -> float:
    """An upper bound, over every parameter gradient, of the fraction of its tolerance that all
    of ``near_decisions``' flips together can move it (each call's effect, summed)."""
    return sum(effect for *_, effect in found)


@dataclass
class FlipFit:
    """``flip_fit``'s answer for one runtime's first step: the decisions it flipped, as
    (module and op, input indices, fitted coefficient); the fitted flips whose coefficient is not
    within ``FLIP_ROUNDING`` of 0 or 1 by a fraction of the flip that moves some gradient element
    past its tolerance (``unsettled``); per gradient key, the worst error past
    rtol x |float64| in units of the tolerance, before and after the flips; the float64 step with
    those flips (loss, every gradient, Adam's update from those gradients, running statistics);
    near elements found and decisions fitted (visible, linked ones)."""

    flipped: list[tuple[str, tuple[int, ...], float]]
    unsettled: list[tuple[str, tuple[int, ...], float]]
    before: dict[str, float]
    residual: dict[str, float]
    record: dict[str, np.ndarray]
    near: int
    fitted: int

    @property
    def explains(self) -> bool:
        """The runtime's step IS float64's with at most ``MAX_FITTED_FLIPS`` near decisions
        flipped: every fitted coefficient settled (``unsettled``), and every gradient within the
        tolerance of the flipped float64 step."""
        return (not self.unsettled and len(self.flipped) <= MAX_FITTED_FLIPS
                and max(self.residual.values(), default=0.0) <= 1)

    def __str__(self) -> str:
        worst = lambda errors: "{:.3g}x ({})".format(*max((v, k) for k, v in errors.items()))  # noqa: E731
        flips = "; ".join(f"{where} {at} s={s:.3f}" for where, at, s in self.flipped) or "none"
        unsettled = "; ".join(f"{where} {at} s={s:.3f}" for where, at, s in self.unsettled)
        return (f"{self.near} elements near a decision, {self.fitted} decisions fitted; worst {worst(self.before)} -> "
                f"{worst(self.residual)} with {len(self.flipped)} flipped: {flips}"
                + (f"; NOT 0 or 1: {unsettled}" if unsettled else ""))


def flip_fit(module: torch.nn.Module, mapping: dict[str, tuple[str, bool]], inputs: dict[str, np.ndarray],
             target: np.ndarray, loss: str, lr: float, got: dict[str, np.ndarray], want: dict[str, np.ndarray],
             noise: dict[str, float], rtol: float = DECISION_RTOL) -> FlipFit:
    """Which near decisions a float32 runtime's first step ``got`` flipped against ``module``'s
    float64 step ``want`` (``module_oracle``, torch's float32 ``noise``), and what is left.

    Each decision within float32 rounding (``near_decisions``: only those may flip; a ReLU input,
    or a max-pool pair of inputs with every window whose two largest they are) has an exact float64
    change of every gradient if it went the other way (``_flip_change``). Fit
    got - want ~ sum_k s_k change_k by least squares over the gradient elements (``FIT_SAMPLE``
    drawn per tensor plus its ``FIT_WORST`` furthest off, each in units of its tolerance: ``rtol``
    of the scale + ``NOISE_FACTOR`` x noise), over the flips that move some gradient element by
    ``FLIP_VISIBLE`` of its tolerance. A flip happened where s is nearer 1 than 0; a coefficient
    further than ``FLIP_ROUNDING`` from both is unsettled where that fraction of its flip moves some
    gradient element past its tolerance (a weaker flip the fit cannot resolve against float32 noise
    of up to the tolerance: the exact check below decides). Then the float64 step
    with exactly those flips (one backward that applies them all, ``_backward``; Adam's update from
    the changed gradients) is compared with ``got`` on every element. ``FlipFit.explains`` says
    whether that proves ``got`` is float64's step with a few decisions rounded the other way."""
    _, _, single = _forward(module, inputs, torch.float32)
    model, out, calls = _forward(module, inputs, torch.float64, single, grad=True)
    params = dict(model.named_parameters())
    near = [c for c in calls if c.count]
    linked = _linked(near)
    value = torch_loss(loss)(out, torch.from_numpy(target))
    cotangents = (torch.autograd.grad(value, [c.link[1] for c in linked], retain_graph=True, allow_unused=True)
                  if linked else ())
    # one decision per ReLU element, one per max-pool input pair (every window whose two largest
    # inputs they are, e.g. overlapping windows sharing them, flips with their order)
    decisions: dict[tuple[int, tuple[int, ...]], list] = {}
    for call, cotangent in zip(linked, cotangents, strict=True):
        for flip in call.flips if cotangent is not None else ():
            decisions.setdefault((id(call), flip[0]), []).append((call, cotangent, flip))
    keys = [k for k in want if k.startswith("grad_") and k in got]
    allowed = {k: tolerance(rtol, want[k], noise.get(k, 0.0)) for k in keys}

    def gradients(change: torch.Tensor, flipped=()) -> dict[str, np.ndarray]:
        """Every gradient key of the float64 backward of a scalar (with ``flipped`` applied)."""
        moved = dict(zip(params, _backward(change, list(params.values()), flipped), strict=True))
        changes = {}
        for k in keys:
            name, transposed = mapping[k[len("grad_"):]]
            m = moved[name]
            changes[k] = np.zeros(want[k].shape) if m is None else (m.numpy().T if transposed else m.numpy())
        return changes

    def errors(record: dict[str, np.ndarray]) -> dict[str, float]:
        return {k: float((np.abs(got[k] - record[k]) - rtol * np.abs(record[k])).max(initial=0.0)) / allowed[k]
                for k in keys}

    rng = np.random.default_rng(0)
    off = {k: np.abs(got[k] - want[k]).flatten() / allowed[k] for k in keys}
    sample = {k: np.union1d(rng.choice(off[k].size, min(off[k].size, FIT_SAMPLE), replace=False),
                            np.argsort(off[k])[-FIT_WORST:]) for k in keys}
    columns, visible, effects = [], [], []
    for flips in decisions.values():
        changes = gradients(sum(_flip_change(*flip) for flip in flips))
        effect = max(float(np.abs(changes[k]).max(initial=0.0)) / allowed[k] for k in keys)
        if effect >= FLIP_VISIBLE:
            visible.append(flips)
            effects.append(effect)
            columns.append(np.concatenate([changes[k].flatten()[sample[k]] / allowed[k] for k in keys]))
    residual = np.concatenate([(got[k] - want[k]).flatten()[sample[k]] / allowed[k] for k in keys])
    fitted = np.linalg.lstsq(np.stack(columns, 1), residual, rcond=None)[0] if columns else np.zeros(0)
    named = [(flips[0][0].where, flips[0][2][0], float(s)) for flips, s in zip(visible, fitted, strict=True)]
    # a coefficient off 0 and 1 by a fraction that moves some gradient element past its tolerance
    unsettled = [n for n, effect in zip(named, effects, strict=True)
                 if (off := min(abs(n[2]), abs(n[2] - 1))) >= FLIP_ROUNDING and off * effect >= 1]
    chosen = [flip for flips, s in zip(visible, fitted, strict=True) if s > 0.5 for flip in flips]
    record = dict(want)
    if chosen:
        plain, flipped = gradients(value), gradients(value, chosen)
        record.update({k: want[k] + (flipped[k] - plain[k]) for k in keys})
        record.update(_adam_update(model, mapping, record, lr))
    return FlipFit([n for n, s in zip(named, fitted, strict=True) if s > 0.5], unsettled, errors(want), errors(record),
                   record, sum(c.count for c in near), len(columns))


def _backward(value: torch.Tensor, params: list[torch.Tensor], flipped=()) -> tuple:
    """``torch.autograd.grad`` of ``value`` (graph retained) with the ``flipped`` (call, cotangent,
    flip) decisions going the other way: at each flipped call the output's cotangent as it arrives
    (every flip downstream already applied) moves to its input as ``_flip_change`` says, so flips
    that interact (one downstream changes the cotangent one upstream moves) are exact together."""
    calls = {id(call): (call, [f for c, _, f in flipped if c is call]) for call, _, _ in flipped}
    handles = []
    for call, flips in calls.values():
        arrived = {}

        def keep(cotangent, arrived=arrived):
            arrived["output"] = cotangent

        def move(cotangent, flips=flips, arrived=arrived):
            change = torch.zeros_like(cotangent).flatten()
            for inputs, fractions, output in flips:
                moved = arrived["output"].flatten()[output]
                change[list(inputs)] += moved * torch.tensor(fractions, dtype=change.dtype)
            return cotangent + change.reshape(cotangent.shape)

        handles += [call.link[1].register_hook(keep), call.link[0].register_hook(move)]
    try:
        return torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()


def _adam_update(model: torch.nn.Module, mapping: dict[str, tuple[str, bool]], record: dict[str, np.ndarray],
                 lr: float) -> dict[str, np.ndarray]:
    """updated_* of ``model``'s parameters after torch's Adam's first step from ``record``'s grad_*."""
    params = dict(model.named_parameters())
    names = {tname: (k, transposed) for k, (tname, transposed) in mapping.items() if f"grad_{k}" in record}
    stepped = {}
    copies = {n: p.detach().clone().requires_grad_() for n, p in params.items() if n in names}
    for n, p in copies.items():
        grad = record[f"grad_{names[n][0]}"]
        p.grad = torch.from_numpy(np.ascontiguousarray(grad.T if names[n][1] else grad))
    torch.optim.Adam(copies.values(), lr=lr).step()
    for n, p in copies.items():
        value = p.detach().numpy()
        stepped[f"updated_{names[n][0]}"] = value.T if names[n][1] else value
    return stepped


def safe_attempt(module: torch.nn.Module, draw: Callable[[int], tuple[dict[str, np.ndarray], np.ndarray]],
                 loss: str) -> int | None:
    """The first attempt (of ``DRAW_ATTEMPTS``) whose ``draw(attempt)`` (inputs, target) keeps
    every decision of ``module``'s float64 step that float32 rounding may flip from moving a
    gradient past the zoo's tolerance (``near_decisions``, ``flip_effect`` < 1): attempt 0 is
    the zoo's plain draw, so a model that is fine there keeps its data. Integer-only data
    (token ids) decides nothing: 0. None: no draw is safe (the comparison is at risk there)."""
    for attempt in range(DRAW_ATTEMPTS):
        inputs, target = draw(attempt)
        if not any(v.dtype.kind == "f" for v in inputs.values()):
            return attempt
        if flip_effect(near_decisions(module, inputs, target, loss, limit=1.0)) < 1:
            return attempt
    return None


def module_case(name: str, module: torch.nn.Module, path: str, inputs: dict[str, np.ndarray], target: np.ndarray,
                loss: str, lr: float = 1e-3, rtol: float = 1e-5, allowed_mismatch: float = 0.0,
                batches: tuple[int, ...] = (), draws: dict[int, int] | None = None) -> Case:
    """A zoo case for a torch module exported to ``path``: its oracle is the module itself (at
    any batch: ``batches`` are checked on the same conversion when the export's batch is symbolic,
    their rows drawn with ``draws``' attempt per batch)."""
    mapping, missing = name_map(module, path)
    assert not missing, f"{name}: torch parameters with no ONNX initializer (folded by the exporter): {missing}"
    params = {n for n, _ in module.named_parameters()}
    trainable = {o for o, (t, _) in mapping.items() if t in params}

    def rebatch(batch_inputs, batch_target):
        return module_oracle(module, mapping, batch_inputs, batch_target, loss, lr)

    def explain(batch_inputs, batch_target, got, want, noise) -> FlipFit:
        return flip_fit(module, mapping, batch_inputs, batch_target, loss, lr, got, want, noise)

    return Case(name, path, inputs, target, loss, trainable, rebatch(inputs, target), lr=lr, rtol=rtol,
                allowed_mismatch=allowed_mismatch, batches=batches, rebatch=rebatch,
                draws=draws or {}, explain=explain)
