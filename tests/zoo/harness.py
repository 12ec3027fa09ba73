"""What every zoo test checks, and the eager-torch oracle for torch modules.

``check_case`` converts a model with a loss and Adam, asserts the trained set, compares the
first step (loss, every gradient, every updated weight and running statistic) with the
oracle's, then runs 30 steps on the same batch and asserts that the loss falls. A model
exported with a symbolic batch (``Case.batches``) is converted once and its first step also
compared with the oracle's at each of those batch sizes (one export and one conversion serve
both the static and the dynamic checks).
``module_steps`` is the oracle for a torch module: real ``torch.optim.Adam`` on the module
itself (train mode, dropout off), its tensors mapped to ONNX initializer names by value.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch.utils._python_dispatch import TorchDispatchMode

import bridge
from reference import torch_steps

LOSS_STEPS = 30
NOISE = 1e-8  # absolute floor: gradients that are exactly zero in theory (e.g. attention key biases)
NOISE_FACTOR = 4  # bridge (float32) may be this many times further from float64 than torch's float32 is
# Where a model allows some elements to miss the tolerance (Case.allowed_mismatch), those may still be
# at most this fraction of the tensor's largest element away: twice the worst measured (densenet121's
# denseblock2.denselayer9.norm1.bias gradient, 7.35%; googlenet 5.05%; see tests/test_zoo_vision.py).
MISMATCH_BOUND = 0.15
# Draws of a torch module's float data tried before giving up (``safe_rows``): attempt 0 is the
# zoo's plain draw. Measured (NOISE_FACTOR x RMS error): mobilenet_v2 at batch 3 needs more than 12.
DRAW_ATTEMPTS = 20


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
    # and the rtol at batch sizes where float32 drifts further (measured, documented per model)
    batches: tuple[int, ...] = ()
    rebatch: Callable[[dict[str, np.ndarray], np.ndarray], Callable] | None = None
    batch_rtol: dict[int, float] = field(default_factory=dict)
    # the torch module whose float64 forward the ``off_batches`` among ``batches`` keep off decisions
    # (``safe_rows``, ``torch_models.OFF_DECISIONS``; None: hand-built ONNX)
    module: torch.nn.Module | None = None
    off_batches: tuple[int, ...] = ()


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
    assert_first_step(case, first, want, noise, tm.initial_state())
    losses = [float(first["loss"])] + [float(session.step(case.inputs, case.target)["loss"]) for _ in range(LOSS_STEPS - 1)]
    assert losses[-1] < 0.9 * losses[0], f"{case.name}: loss did not fall over {LOSS_STEPS} steps: {losses}"
    if case.batches:
        assert_symbolic_batch(tm, case)
    for batch in case.batches:
        check_batch(case, tm, batch)
    case.timings.update(convert=convert, total=time.perf_counter() - start)
    return case.timings


def rows(array: np.ndarray, batch: int, attempt: int = 0) -> np.ndarray:
    """A batch of ``batch`` rows like ``array``: fresh normal samples for float data (seeded by
    ``batch``, and ``attempt`` after the first), rows taken cyclically for integer data (keeps
    token ids, masks and labels valid)."""
    if array.dtype.kind == "f":
        rng = np.random.default_rng(batch if attempt == 0 else (batch, attempt))
        return rng.standard_normal((batch, *array.shape[1:])).astype(array.dtype)
    return np.take(array, np.arange(batch) % array.shape[0], axis=0)


def batch_rows(inputs: dict[str, np.ndarray], target: np.ndarray, batch: int, module: torch.nn.Module | None = None,
               name: str = "") -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs, target) of ``batch`` rows: ``rows`` of each; with a torch ``module``, the float
    inputs are drawn again (``safe_rows``) until its float64 forward keeps off every decision."""
    def draw(attempt: int) -> dict[str, np.ndarray]:
        return {k: rows(v, batch, attempt) for k, v in inputs.items()}

    if module is None:
        return draw(0), rows(target, batch)
    return safe_rows(module, draw, f"{name}@batch{batch}"), rows(target, batch)


def assert_symbolic_batch(tm: bridge.TrainingModel, case: Case) -> None:
    """Every data input and the target of ``tm`` keep the export's symbolic batch dim."""
    dims = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in tm.model.graph.input
            if i.name in [*case.inputs, "target"]}
    assert set(dims.values()) == {"batch"}, f"{case.name}: batch dims {dims}"


def check_batch(case: Case, tm: bridge.TrainingModel, batch: int) -> None:
    """The first step of ``tm`` (converted once) at ``batch`` rows matches the oracle's at that batch."""
    inputs, target = batch_rows(case.inputs, case.target, batch, case.module if batch in case.off_batches else None,
                                case.name)
    got = tm.session().step(inputs, target)
    want, noise = case.rebatch(inputs, target)()
    at_batch = replace(case, name=f"{case.name}@batch{batch}", inputs=inputs, target=target,
                       rtol=case.batch_rtol.get(batch, case.rtol))
    assert_first_step(at_batch, got, want, noise, tm.initial_state())


def assert_onnx_mlir_clean(tm: bridge.TrainingModel, name: str) -> None:
    """No violation of onnx-mlir's op table, except the source model's own forward Casts (HF
    attention masks cast int64 -> float/bool; the table allows Cast between float types only)."""
    phases = {n.name: {p.key: p.value for p in n.metadata_props}.get("bridge.phase") for n in tm.model.graph.node}
    added = [v for v in bridge.check(tm.model, target="onnx-mlir") if not (v.op == "Cast" and phases.get(v.node) == "forward")]
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
        tolerances[key] = tolerance(case, expected, noise.get(key, 0.0))
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


def scale_of(expected: np.ndarray) -> float:
    """A tensor's largest magnitude (0 when empty)."""
    return float(np.max(np.abs(expected))) if expected.size else 0.0


def tolerance(case: Case, expected: np.ndarray, noise: float) -> float:
    """The absolute error allowed on ``expected``: ``rtol`` of its scale, the floor ``NOISE``, and
    ``NOISE_FACTOR`` times the oracle's own float32 error ``noise`` on it."""
    return case.rtol * scale_of(expected) + NOISE + NOISE_FACTOR * noise


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


def window_gaps(x: torch.Tensor, out: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1,
                ceil_mode=False) -> torch.Tensor:
    """Per max-pool window (of ``out``'s size), its largest input minus its second largest."""
    (kh, kw), (ph, pw), (dh, dw) = _pair(kernel_size), _pair(padding), _pair(dilation)
    sh, sw = _pair(stride) if len(stride or ()) else (kh, kw)
    if kh * kw < 2:
        return torch.full(out.shape, torch.inf, dtype=x.dtype)
    planes = x.reshape(-1, 1, *x.shape[-2:])  # ceil_mode's last window may pass the end: pad one stride more
    padded = F.pad(planes, (pw, pw + sw, ph, ph + sh), value=-torch.inf)
    height, width = ((padded.shape[2 + i] - d * (k - 1) - 1) // s + 1 for i, k, s, d in ((0, kh, sh, dh), (1, kw, sw, dw)))
    windows = F.unfold(padded, (kh, kw), dilation=(dh, dw), stride=(sh, sw)).reshape(len(planes), kh * kw, height, width)
    top = windows[:, :, :out.shape[-2], :out.shape[-1]].topk(2, dim=1).values
    return (top[:, 0] - top[:, 1]).reshape(out.shape)


def _margins(func, args, kwargs) -> torch.Tensor | None:
    """Each element's distance from the decision ``func`` takes on it (None: ``func`` takes none)."""
    packet = func.overloadpacket
    if packet in KINKS:
        kinks = KINKS[packet](*args[1:], **kwargs)
        return torch.stack([(args[0] - k).abs() for k in kinks]).amin(0) if kinks else None
    if packet in MAX_POOLS:
        out = func(*args, **kwargs)
        return window_gaps(args[0], out[0] if isinstance(out, tuple) else out, *args[1:], **kwargs)
    return None


class _Decisions(TorchDispatchMode):
    """Records the input of every decision op (``KINKS``, ``MAX_POOLS``) in call order, with the
    innermost module running it; given ``single`` (the same forward's records in float32),
    measures each one's margins against that tensor's float32 error instead."""

    def __init__(self, names: dict[int, str], single: list | None = None):
        super().__init__()
        self.names, self.single, self.stack, self.records = names, single, [""], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in KINKS or func.overloadpacket in MAX_POOLS:
            where = f"{self.stack[-1]} ({func.overloadpacket.__name__})"
            if self.single is None:
                self.records.append((where, args[0].detach().clone()))
            else:
                self.records.append(self._near(where, func, args, kwargs))
        return func(*args, **kwargs)

    def _near(self, where, func, args, kwargs) -> tuple[str, int, float, float]:
        single_where, single = self.single[len(self.records)]
        assert single_where == where, f"float32 and float64 forwards differ: {single_where} vs {where}"
        margins = _margins(func, args, kwargs)
        if margins is None or not margins.numel():
            return where, 0, torch.inf, 0.0
        error = float((single.double() - args[0]).pow(2).mean().sqrt())
        margins = margins[margins > 0]  # exact ties (ReLU zeros in a window) go the same way in any runtime
        closest = float(margins.min()) if margins.numel() else torch.inf
        return where, int((margins < NOISE_FACTOR * error).sum()), closest, error


def _forward_records(module: torch.nn.Module, inputs: dict[str, np.ndarray], dtype, single=None) -> list:
    """One training-mode forward of a copy of ``module`` in ``dtype`` under ``_Decisions``."""
    model = dropout_off(copy.deepcopy(module)).train().to(dtype)
    names = {id(m): n for n, m in model.named_modules()}
    mode = _Decisions(names, single)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(
                 lambda m, _: mode.stack.append(names.get(id(m), type(m).__name__)) and None),
             torch.nn.modules.module.register_module_forward_hook(lambda *_: mode.stack.pop() and None)]
    try:
        with torch.no_grad(), mode:
            model(*_torch_args(inputs, dtype))
    finally:
        for hook in hooks:
            hook.remove()
    return mode.records


def near_decisions(module: torch.nn.Module, inputs: dict[str, np.ndarray]) -> list[tuple[str, int, float, float]]:
    """Where ``module``'s float64 training-mode forward on ``inputs`` is at a decision: for each
    kinked activation (``KINKS``) and max pool (``MAX_POOLS``) call, (module and op, elements
    closer to a kink, or windows whose two largest inputs are closer to each other, than
    ``NOISE_FACTOR`` x that input's float32 error, the smallest such distance, the error),
    listing only calls with such elements. The float32 error is measured: the largest
    |float32 - float64| over the input tensor in the same forward in float32.

    There the gradient is not defined by the model, only by rounding: a float32 runtime may
    route it to either side, so comparing two of them (or one with float64) tests luck."""
    single = _forward_records(module, inputs, torch.float32)
    wide = _forward_records(module, inputs, torch.float64, single)
    assert len(wide) == len(single), f"float32 and float64 forwards differ: {len(single)} vs {len(wide)} decisions"
    return [record for record in wide if record[1]]


def safe_rows(module: torch.nn.Module, draw: Callable[[int], dict[str, np.ndarray]], name: str) -> dict[str, np.ndarray]:
    """``draw(attempt)`` for the first attempt (of ``DRAW_ATTEMPTS``) whose float data keeps
    ``module``'s float64 forward off every decision (``near_decisions``); attempt 0 is the
    zoo's plain draw, so a model that is fine there keeps its data. Integer-only data
    (token ids) is taken as drawn."""
    inputs = draw(0)
    if not any(v.dtype.kind == "f" for v in inputs.values()):
        return inputs
    found = []
    for attempt in range(DRAW_ATTEMPTS):
        inputs = draw(attempt) if attempt else inputs
        found = near_decisions(module, inputs)
        if not found:
            return inputs
    raise AssertionError(f"{name}: none of {DRAW_ATTEMPTS} draws keeps the float64 forward {NOISE_FACTOR}x float32 "
                         f"error from every kink and max-pool tie; the last is close at {found[:5]}")


def module_case(name: str, module: torch.nn.Module, path: str, inputs: dict[str, np.ndarray], target: np.ndarray,
                loss: str, lr: float = 1e-3, rtol: float = 1e-5, allowed_mismatch: float = 0.0,
                batches: tuple[int, ...] = (), batch_rtol: dict[int, float] | None = None,
                off_batches: tuple[int, ...] = ()) -> Case:
    """A zoo case for a torch module exported to ``path``: its oracle is the module itself (at
    any batch: ``batches`` are checked on the same conversion when the export's batch is symbolic,
    the rows of ``off_batches`` among them drawn off decisions)."""
    mapping, missing = name_map(module, path)
    assert not missing, f"{name}: torch parameters with no ONNX initializer (folded by the exporter): {missing}"
    params = {n for n, _ in module.named_parameters()}
    trainable = {o for o, (t, _) in mapping.items() if t in params}

    def rebatch(batch_inputs, batch_target):
        return module_oracle(module, mapping, batch_inputs, batch_target, loss, lr)

    return Case(name, path, inputs, target, loss, trainable, rebatch(inputs, target), lr=lr, rtol=rtol,
                allowed_mismatch=allowed_mismatch, batches=batches, rebatch=rebatch, batch_rtol=batch_rtol or {},
                module=module, off_batches=off_batches)
