"""Independent oracles for one training step of an ONNX model.

The gradient oracle is float64 central finite differences of the mse loss of the *source*
model, evaluated by ONNX's own reference evaluator (``onnx.reference``): neither bridge's
importer nor torch is involved (the float64 copy is ``bridge.tools.verify.as_float64``, the one
float64 converter, checked against the float32 model in tests/test_verify.py). Tolerances are multiples of measured noise:

- the finite-difference noise of each weight is measured by differencing with two step sizes
  (``h`` and ``2h``); the float64 training graph must agree within ``FD_NOISE_FACTOR`` times it
  (plus a floor of ``FLOAT64_FLOOR`` of the gradient's scale);
- the float32 training graph (what users run) must agree with the float64 one within
  ``FLOAT32_ULPS`` float32 unit roundoffs of the gradient's scale, or, where the computation is
  ill-conditioned (recurrences, long reductions), within ``TORCH_NOISE_FACTOR`` times torch
  autograd's own float32 error on the same program (``torch_float32_noise``).

``check_training_step`` runs the whole path (convert, onnx-mlir check, one SGD step in float64
and in float32) and returns a ``StepCheck`` whose ``failures()`` lists every disagreement.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_grid_sample import GridSample as _ReferenceGridSample
from onnx.reference.ops.op_resize import Resize as _ReferenceResize

import bridge
from bridge.tools.verify import as_float64, scale_of

FD_NOISE_FACTOR = 20.0
FLOAT64_FLOOR = 1e-9
FLOAT32_ULPS = 2.0**10  # of float32 unit roundoff (2**-24): 6e-5 of the gradient's scale
FLOAT32_EPS = 2.0**-24
TORCH_NOISE_FACTOR = 10.0  # bridge's float32 gradient may be this many times as far from float64 as torch's
TWIN_ULPS = 16.0  # float64 unit roundoffs of the gradient's scale: bridge's float64 graph vs the torch twin
LR = 0.125  # a power of two: the lr input is float32 even in a float64 graph
OPTIONS = {"loss": "mse", "optim": "sgd", "optim_options": {"lr": LR}}  # the step checked: one mse + SGD step


_erf = np.vectorize(math.erf, otypes=[np.float64])


class Erf(OpRun):
    """Erf at the input's precision (onnx.reference's Erf computes in float32 whatever the input:
    its float64 finite differences would carry float32 noise)."""

    op_domain = ""

    def _run(self, x):
        return (_erf(x).astype(x.dtype),)


class Gelu(OpRun):
    """Gelu at the input's precision (onnx.reference runs Gelu's function body: float32 Erf and
    float32 constants)."""

    op_domain = ""

    def _run(self, x, approximate=None):
        if approximate == "tanh":
            y = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        else:
            y = 0.5 * x * (1 + _erf(x / math.sqrt(2)))
        return (y.astype(x.dtype),)


class GridSample(_ReferenceGridSample):
    """GridSample with its pixel coordinates at the grid's precision (onnx.reference's are float32)
    and opset 16's mode names (bilinear, bicubic)."""

    def _gs_denormalize_coordinates(self, n, dims, align_corners: bool):
        return np.array([self._gs_denormalize(v, d, align_corners) for v, d in zip(n, dims, strict=True)], dtype=n.dtype)

    def _run(self, X, grid, mode=None, padding_mode=None, align_corners=None):
        mode = mode or self.mode
        return super()._run(X, grid, {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode), padding_mode,
                            align_corners)


class Resize(_ReferenceResize):
    """Resize with ``cubic_coeff_a`` as a Python float: onnx.reference's float32 attribute makes its
    antialiased cubic coefficients float32 (numpy's promotion of a float32 scalar)."""

    def _run(self, X, roi, scales=None, sizes=None, cubic_coeff_a=None, **attrs):
        a = None if cubic_coeff_a is None else float(cubic_coeff_a)
        return super()._run(X, roi, scales, sizes, cubic_coeff_a=a, **attrs)


REFERENCE_OPS = [Erf, Gelu, GridSample, Resize]  # replace onnx.reference's float32-only implementations


def weights_as_inputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` with the initializers ``names`` turned into graph inputs (so an evaluator can be
    fed perturbed weights without being rebuilt)."""
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    keep = [init for init in moved.graph.initializer if init.name not in names]
    inputs = [helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
              for init in moved.graph.initializer if init.name in names]
    del moved.graph.initializer[:]
    moved.graph.initializer.extend(keep)
    existing = {i.name for i in moved.graph.input}
    moved.graph.input.extend(i for i in inputs if i.name not in existing)
    return moved


def mse(output: np.ndarray, target: np.ndarray) -> float:
    return float(np.mean((np.asarray(output, np.float64) - target) ** 2))


def finite_difference_gradients(
    model64: onnx.ModelProto, feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
    target: np.ndarray, *, output_index: int = 0, max_elements: int = 24, seed: int = 0, h: float = 1e-6,
    budget_s: float | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """Per weight: (flat indices sampled, central-difference gradient there, measured FD noise).

    The noise is ``max |FD(h) - FD(2h)|`` over the sampled elements: the truncation and rounding
    error of the difference quotient, measured rather than assumed. ``budget_s``: sample fewer
    elements (at least one per weight) where evaluations are slow (the reference evaluator's
    pooling over a 3-D volume takes seconds), so that all of them take about this long.
    """
    evaluator = ReferenceEvaluator(weights_as_inputs(model64, list(weights)), new_ops=REFERENCE_OPS)
    base = {**{k: np.asarray(v) for k, v in feeds.items()}, **{k: np.array(v, np.float64) for k, v in weights.items()}}

    def loss(feed) -> float:
        return mse(evaluator.run(None, feed)[output_index], target)

    if budget_s is not None and weights:
        start = time.perf_counter()
        loss(base)
        per_weight = budget_s / (4 * (time.perf_counter() - start) * len(weights))
        max_elements = max(1, min(max_elements, int(per_weight)))
    rng = np.random.default_rng(seed)
    result = {}
    for name, value in weights.items():
        count = min(value.size, max_elements)
        indices = np.sort(rng.choice(value.size, size=count, replace=False)) if value.size else np.zeros(0, int)
        grads, noise = np.zeros(count), 0.0
        for k, flat in enumerate(indices):
            quotients = []
            for step in (h, 2 * h):
                scaled = step * max(1.0, abs(float(value.reshape(-1)[flat])))
                plus, minus = dict(base), dict(base)
                plus[name] = base[name].copy()
                minus[name] = base[name].copy()
                plus[name].reshape(-1)[flat] += scaled
                minus[name].reshape(-1)[flat] -= scaled
                quotients.append((loss(plus) - loss(minus)) / (2 * scaled))
            grads[k] = quotients[0]
            noise = max(noise, abs(quotients[0] - quotients[1]))
        result[name] = (indices, grads, noise)
    return result


def twin_gradients(twin: Callable[..., Any], feeds: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
                   target: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """The mse loss and its float64 autograd gradients of a torch twin of the model, called with
    the model's inputs and weights by name: the oracle at kinks, where finite differences mean
    nothing and torch's convention is the truth."""
    import torch

    params = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in weights.items()}
    data = {k: torch.tensor(np.asarray(v)) for k, v in feeds.items()}
    loss = torch.mean((twin(**data, **params) - torch.tensor(target)) ** 2)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), {k: g.numpy() for k, g in zip(params, grads, strict=True)}


def run_reference(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """``model`` run by ONNX's reference evaluator."""
    return ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(None, dict(feeds))


def step_outputs(tm: bridge.TrainingModel, inputs: Mapping[str, np.ndarray], target: np.ndarray,
                 noise: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One training step of ``tm`` in onnxruntime; where onnxruntime has no kernel for a dtype
    (float64 is partly covered), in ONNX's reference evaluator."""
    feed = {**tm.initial_state(), **dict(inputs), **dict(noise or {}), "target": target}
    try:
        session = tm.session()
    except Exception as exc:  # onnxruntime: NOT_IMPLEMENTED kernel for this dtype
        if "NOT_IMPLEMENTED" not in str(exc) and "Could not find an implementation" not in str(exc):
            raise
        names = [o.name for o in tm.model.graph.output]
        return dict(zip(names, run_reference(tm.model, feed), strict=True))
    return session._run(feed)


@dataclass
class StepCheck:
    """Scale-relative errors of one training step against the oracles, and their bounds."""

    weights: list[str]
    errors: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def record(self, key: str, error: float, bound: float) -> None:
        self.errors[key], self.bounds[key] = error, bound

    def failures(self) -> list[str]:
        bad = [f"{k}: error {self.errors[k]:.3g} > bound {self.bounds[k]:.3g}"
               for k in self.errors if not self.errors[k] <= self.bounds[k]]
        return bad + [f"onnx-mlir: {v}" for v in self.violations]


def _random_noise(tm: bridge.TrainingModel, inputs: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Values for the per-step noise inputs (``<node>.noise``) of random ops."""
    rng = np.random.default_rng(seed)
    by_name = {i.name: i for i in tm.model.graph.input}
    noise = {}
    for name in tm.signature.random:
        dims = [d.dim_value for d in by_name[name].type.tensor_type.shape.dim]
        elem = by_name[name].type.tensor_type.elem_type
        noise[name] = rng.random(dims).astype(np.float64 if elem == TensorProto.DOUBLE else np.float32)
    return noise


def _as_input_dtypes(tm: bridge.TrainingModel, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``values`` cast to the dtypes of the training graph's inputs of the same names."""
    dtypes = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in tm.model.graph.input}
    return {k: np.asarray(v).astype(dtypes[k]) for k, v in values.items()}


def check_training_step(
    model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], *, output_index: int = 0,
    max_elements: int = 24, seed: int = 0, float32: bool = True, reference: onnx.ModelProto | None = None,
    fd_budget_s: float | None = None, loss_rtol: float = 1e-12, twin: Callable[..., Any] | None = None,
    **convert_options,
) -> StepCheck:
    """Convert ``model`` (mse, SGD), run one step in float64 and (``float32``) float32, compare.

    Checks: the float64 step's loss equals the reference evaluator's, its gradients equal
    float64 finite differences of the source model, its update is ``w - lr * grad``; the float32
    training graph checks clean for onnx-mlir and its gradients equal the float64 ones.
    ``reference`` (default ``model``) is the model the reference evaluator runs for the loss and
    the finite differences, where ONNX spells what bridge trains differently (an inference
    BatchNormalization trains with batch statistics: its reference has ``training_mode=1``).
    ``fd_budget_s``: the finite differences' time budget (``finite_difference_gradients``).
    ``loss_rtol``: the loss's bound relative to its scale (ONNX float attributes are float32:
    evaluators that widen a default such as HardSigmoid's alpha=0.2 differently differ by ~1e-9).
    ``twin``: a torch function of the model's inputs and weights by name; where given, the loss
    and gradients are compared with its float64 autograd (``twin_gradients``), not with finite
    differences (inputs at kinks, where torch's convention decides the gradient).
    """
    model64 = as_float64(model)
    reference64 = model64 if reference is None else as_float64(reference)
    inputs64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    options = dict(OPTIONS, output=output_index, **convert_options)
    tm64 = bridge.to_training_onnx(model64, **options)
    rng = np.random.default_rng(seed)
    out_shape = run_reference(reference64, inputs64)[output_index].shape
    target = rng.standard_normal(out_shape)
    noise64 = _random_noise(tm64, inputs64, seed)
    got64 = step_outputs(tm64, inputs64, target, noise64)
    result = StepCheck(list(tm64.weights))

    state = tm64.initial_state()
    if twin is not None:
        twin_loss, twin_grads = twin_gradients(twin, inputs64, {w: state[w] for w in tm64.weights}, target)
        result.record("loss", abs(float(got64["loss"]) - twin_loss), loss_rtol * max(1.0, abs(twin_loss)))
        for w, want in twin_grads.items():
            got = np.asarray(got64[f"grad_{w}"], np.float64)
            result.record(f"grad_{w} vs torch twin", float(np.max(np.abs(got - want), initial=0.0)),
                          TWIN_ULPS * np.finfo(np.float64).eps * max(scale_of(want), 1.0))
    elif not noise64:
        reference_loss = mse(run_reference(reference64, {**inputs64, **{w: state[w] for w in tm64.weights}})[output_index], target)
        result.record("loss", abs(float(got64["loss"]) - reference_loss), loss_rtol * max(1.0, abs(reference_loss)))
        fd = finite_difference_gradients(reference64, inputs64, {w: state[w] for w in tm64.weights}, target,
                                         output_index=output_index, max_elements=max_elements, seed=seed,
                                         budget_s=fd_budget_s)
        for w, (indices, grads, fd_noise) in fd.items():
            got = np.asarray(got64[f"grad_{w}"], np.float64).reshape(-1)[indices]
            scale = max(scale_of(grads), scale_of(got64[f"grad_{w}"]))
            result.record(f"grad_{w} vs finite differences", float(np.max(np.abs(got - grads), initial=0.0)),
                          FD_NOISE_FACTOR * fd_noise + FLOAT64_FLOOR * max(scale, 1.0))
    for w in tm64.weights:
        want = state[w] - LR * got64[f"grad_{w}"]
        result.record(f"updated_{w}", float(np.max(np.abs(got64[f"updated_{w}"] - want), initial=0.0)),
                      4 * np.finfo(np.float64).eps * max(scale_of(want), 1.0))

    if float32:
        tm32 = bridge.to_training_onnx(model, **options)
        result.violations = list(bridge.check(tm32.model, target="onnx-mlir", compile=False))
        fed32 = _as_input_dtypes(tm32, {**noise64, "target": target})  # float64 for a float64 source
        got32 = step_outputs(tm32, inputs, fed32.pop("target"), fed32)
        errors = {w: float(np.max(np.abs(np.asarray(got32[f"grad_{w}"], np.float64) - np.asarray(got64[f"grad_{w}"])), initial=0.0))
                  for w in tm64.weights}
        bounds = {w: FLOAT32_ULPS * FLOAT32_EPS * max(scale_of(got64[f"grad_{w}"]), 1e-30) + 1e-30 for w in tm64.weights}
        if any(errors[w] > bounds[w] for w in tm64.weights):  # ill-conditioned: how noisy is torch itself?
            torch_noise = torch_float32_noise(model, inputs, target, tm64.weights, output_index, noise64)
            bounds = {w: max(bounds[w], TORCH_NOISE_FACTOR * torch_noise[w]) for w in tm64.weights}
        for w in tm64.weights:
            result.record(f"grad_{w} float32", errors[w], bounds[w])
    return result


def torch_float32_noise(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], target: np.ndarray,
                        weights: list[str], output_index: int, noise: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per weight, ``max |g32 - g64|`` of torch autograd's mse gradient of the imported program
    in float32 and in float64: the float32 noise of the computation itself (recurrences, long
    reductions), against which bridge's float32 graph is judged where it exceeds ``FLOAT32_ULPS``."""
    import torch

    from bridge.pipeline.importer.program import OnnxProgram
    from bridge.pipeline.load import load_model

    grads = []
    for source, dtype in ((model, torch.float32), (as_float64(model), torch.float64)):
        program = OnnxProgram(load_model(source))
        params = {w: program.initializer_tensor(w).to(dtype).requires_grad_() for w in weights}
        feed = {k: torch.tensor(v).to(dtype) if np.issubdtype(v.dtype, np.floating) else torch.tensor(v) for k, v in inputs.items()}
        random = {k: torch.tensor(v).to(dtype) for k, v in noise.items()}
        output = program.run(feed, params, training=True, random=random)[0][output_index]
        loss = torch.mean((output.to(torch.float64) - torch.tensor(target)) ** 2)
        grads.append(torch.autograd.grad(loss, list(params.values()), allow_unused=True))
    return {w: 0.0 if g32 is None else float(torch.max(torch.abs(g32.double() - g64)).item()) if g32.numel() else 0.0
            for w, g32, g64 in zip(weights, *grads, strict=True)}
