"""Every optimizer, with and without its main options, on an MLP and a small CNN: 20 steps in
onnxruntime vs torch.optim.

The learning rate is halved at step 10 in both (a live ``lr`` input vs the param group's lr),
and every step's loss, gradients and updated weights must match within 1e-5 relative.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, random_batches
from helpers.training import module_steps

import bridge
from bridge.pipeline.optimizers import available_optimizers, make_optimizer
from bridge.tools.target_check import check

STEPS, HALVE_AT = 20, 10

CLASSES = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop, "adadelta": torch.optim.Adadelta, "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam,
}

# Learning rates keep the 20 steps from diverging: on a diverging trajectory (gradient ascent with
# momentum, RMSprop's ~1/(1-momentum) * lr / sqrt(1-alpha) steps) float32 noise (conv gradients summed
# in another order by onnxruntime and oneDNN, ~2e-7 relative) grows past any fixed tolerance.
CASES = [
    ("sgd", {"lr": 0.05}),
    ("sgd", {"lr": 0.05, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.005, "momentum": 0.9, "nesterov": True, "maximize": True}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01}),
    ("adam", {"lr": 0.01, "amsgrad": True, "maximize": True}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    ("adagrad", {"lr": 0.05}),
    ("adagrad", {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-8, "weight_decay": 0.01}),
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "alpha": 0.9, "centered": True}),
    ("rmsprop", {"lr": 0.002, "momentum": 0.9, "weight_decay": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.5, "maximize": True}),
    ("adadelta", {}),
    ("adadelta", {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.01}),
    ("adamax", {"lr": 0.01}),
    ("adamax", {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.01, "maximize": True}),
    ("nadam", {"lr": 0.01}),
    ("nadam", {"lr": 0.01, "momentum_decay": 0.01, "weight_decay": 0.01}),
    ("nadam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("radam", {"lr": 0.01}),
    ("radam", {"lr": 0.01, "weight_decay": 0.01}),
    ("radam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
]


def _case_id(case) -> str:
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items() if k != "lr")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    path = tmp_path_factory.mktemp("optim") / "mlp.onnx"
    torch.onnx.export(module, (torch.randn(5, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return module, str(path)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """Conv -> MaxPool -> Tanh -> Flatten -> Linear (no ReLU before the pool: no tied maxima)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.MaxPool2d(2), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(48, 4)
    )
    path = tmp_path_factory.mktemp("optim") / "cnn.onnx"
    torch.onnx.export(module, (torch.randn(3, 2, 8, 8),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return module, str(path)


def _run_both(module, path, optim, options, max_grad_norm=None):
    tm = bridge.to_training_onnx(path, loss="mse", optim=optim, optim_options=options, clip_grad_norm=max_grad_norm)
    batches = random_batches(tm, STEPS, seed=3)
    lr = make_optimizer(optim, options).lr
    schedule = {HALVE_AT: lr / 2}
    torch_class = optim if isinstance(optim, type) else CLASSES[optim]
    want = module_steps(module, batches, F.mse_loss, torch_class, options, lr_schedule=schedule,
                        max_grad_norm=max_grad_norm)
    return bridge_steps(tm, batches, schedule), want, tm


# The richest configuration of each optimizer: the one make test-fast runs 20 steps of (the
# others are ``slow``), and the one compiled by IREE (llvm-cpu), an MLIR compiler like onnx-mlir
# (with clipping): the step must train as in onnxruntime.
COMPILED = [max((c for c in CASES if c[0] == name), key=lambda c: len(c[1])) for name in CLASSES]


@pytest.mark.parametrize("case", [c if c in COMPILED else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=_case_id)
def test_mlp_20_steps_match_torch_optim(mlp, case):
    got, want, tm = _run_both(*mlp, *case)
    assert_steps_match(got, want)
    assert not check(tm.model, compile=False), "onnx-mlir accepts every op"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cnn_20_steps_match_torch_optim(cnn, case):
    got, want, _ = _run_both(*cnn, *case)
    assert_steps_match(got, want)


def test_every_optimizer_is_covered():
    assert {name for name, _ in CASES} == set(available_optimizers()) == set(CLASSES)


def test_optimizer_class_is_accepted(mlp):
    got, want, tm = _run_both(*mlp, torch.optim.NAdam, {"lr": 0.01})
    assert tm.model.metadata_props and any(p.value == "nadam" for p in tm.model.metadata_props)
    assert_steps_match(got, want)


@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipping", "below_limit"])
@pytest.mark.parametrize("optim, options", [("sgd", {"lr": 0.05, "momentum": 0.9}), ("adam", {"lr": 0.01})])
def test_clip_grad_norm_matches_torch(mlp, optim, options, max_norm):
    got, want, tm = _run_both(*mlp, optim, options, max_grad_norm=max_norm)
    assert_steps_match(got, want)
    kinds = {
        dict((p.key, p.value) for p in node.metadata_props).get("bridge.kind") for node in tm.model.graph.node
    }
    assert "clip_grad_norm" in kinds


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_state_slots_and_initial_values_are_torch_optims(case):
    """Slot names (in torch's order), shapes, dtypes and initial values equal torch.optim's state."""
    name, options = case
    param = torch.nn.Parameter(torch.randn(3, 4))
    ours = make_optimizer(name, options).initial_state(param.detach())
    opt = CLASSES[name]([param], **options)
    initial = {k: v.clone() for k, v in opt.state[param].items()}  # Adagrad fills its state at construction
    param.grad = torch.zeros_like(param)
    opt.step()  # the others create it lazily; record only what the first step created
    torch_slots = [k for k in opt.state[param] if k != "step"]
    assert list(ours) == torch_slots
    for slot in torch_slots:
        expected = initial.get(slot, torch.ones(()) if slot == "mu_product" else torch.zeros_like(param))
        assert ours[slot].dtype == opt.state[param][slot].dtype
        assert ours[slot].shape == opt.state[param][slot].shape
        torch.testing.assert_close(ours[slot], expected, rtol=0, atol=0)


@pytest.mark.iree
def test_converted_model_carries_the_slots(mlp):
    tm = bridge.to_training_onnx(mlp[1], loss="mse", optim="nadam")
    state = tm.initial_state()
    assert [k for k in state if k.startswith("0.weight.")] == [f"0.weight.{s}" for s in ("mu_product", "exp_avg", "exp_avg_sq")]
    assert state["0.weight.mu_product"].shape == () and state["0.weight.mu_product"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILED, ids=_case_id)
def test_compiled_update_matches_onnxruntime(mlp, case):
    name, options = case
    tm = bridge.to_training_onnx(mlp[1], loss="mse", optim=name, optim_options=options, clip_grad_norm=1.0)
    batches = random_batches(tm, 3, seed=5)
    iree = bridge.compile(tm).session()
    ort = tm.session()
    assert_steps_match([iree.step(*b) for b in batches], [ort.step(*b) for b in batches])


# The default forms of each optimizer's update: the rule's shortcuts (Adam's bias corrections as per-step
# scalars, SGD's momentum buffer at step 1 with and without dampening) against torch at steps 1, 2 and 3.
DEFAULT_FORMS = [
    ("adam", {}), ("adamw", {}), ("sgd", {"momentum": 0.9}), ("sgd", {"momentum": 0.9, "dampening": 0.1}),
    ("rmsprop", {}),
]


@pytest.mark.parametrize("optim, options", DEFAULT_FORMS, ids=lambda v: str(v))
def test_default_update_forms_match_torch_optim(mlp, optim, options):
    """3 steps of every weight's update vs torch.optim, with the optimizer's default lr."""
    module, path = mlp
    tm = bridge.to_training_onnx(path, loss="mse", optim=optim, optim_options=options)
    batches = random_batches(tm, 3, seed=7)
    want = module_steps(module, batches, F.mse_loss, CLASSES[optim], {**options, "lr": make_optimizer(optim, options).lr})
    assert_steps_match(bridge_steps(tm, batches), want)


ROUNDING_CASES = [
    ("adam", {"lr": 1e-3}), ("adam", {"lr": 1e-2, "amsgrad": True}), ("adamw", {"lr": 1e-3, "weight_decay": 0.1}),
    ("sgd", {"lr": 1e-3, "momentum": 0.9}), ("sgd", {"lr": 1e-3, "momentum": 0.9, "dampening": 0.1}),
    ("rmsprop", {"lr": 1e-3}), ("rmsprop", {"lr": 1e-3, "momentum": 0.9, "centered": True}),
]


@pytest.mark.parametrize("case", ROUNDING_CASES, ids=_case_id)
def test_update_rounding_is_within_torch_float32_noise(case):
    """The rule's float32 arithmetic (the graph's, run eagerly) over 30 steps of heavy-tailed
    gradients: no farther from torch.optim's float32 result than torch's float32 is from its
    float64 result, and at most twice as far from float64 as torch's float32 (measured: 1.0x for
    Adam, AdamW and RMSprop, 1.2-1.5x for SGD with momentum, whose update torch computes as one
    fused multiply-add, which ONNX lacks). The rule reorders torch's arithmetic (Adam's bias
    correction folded into per-step scalars), which moves single roundings, not the error scale."""
    name, options = case
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(8_192, generator=generator)
    grads = [torch.randn(8_192, generator=generator) * torch.exp(2 * torch.randn(8_192, generator=generator))
             for _ in range(30)]
    torch_results = {}
    for dtype in (torch.float32, torch.float64):
        param = torch.nn.Parameter(start.to(dtype, copy=True))
        opt = CLASSES[name]([param], foreach=False, **options)
        for grad in grads:
            param.grad = grad.to(dtype)
            opt.step()
        torch_results[dtype] = param.detach().double()
    optimizer = make_optimizer(name, options)
    ours, state = start.clone(), optimizer.initial_state(start)
    for step, grad in enumerate(grads, start=1):
        ours, state = optimizer.update(ours, grad, state, torch.tensor(step), torch.tensor(optimizer.lr))
    exact, torch32 = torch_results[torch.float64], torch_results[torch.float32]
    scale = exact.abs().max()
    torch_noise = (torch32 - exact).abs().max() / scale
    assert (ours.double() - torch32).abs().max() / scale <= torch_noise
    assert (ours.double() - exact).abs().max() / scale <= 2 * torch_noise


@pytest.mark.parametrize("optim", ["adam", "adamw"])
def test_adam_at_lr_0_leaves_every_weight_unchanged(mlp, optim):
    """At lr 0, set when converting or at run time (a schedule's first step), Adam's update is exactly 0,
    also for a weight whose gradient is 0 (a second moment of 0): a form that divided by the step size
    (folding it into the denominator) would make it NaN."""
    tm = bridge.to_training_onnx(mlp[1], loss="mse", optim=optim, optim_options={"lr": 0.0})
    session = tm.session()
    x, target = np.zeros((5, 6), np.float32), np.ones((5, 4), np.float32)  # zero input: the first weight's gradient is 0
    for step in range(2):
        before = {name: session.state[name].copy() for name in tm.weights}
        results = session.step({"x": x}, target)
        assert step or not results["grad_0.weight"].any()
        for name, value in before.items():
            np.testing.assert_array_equal(session.state[name], value, err_msg=f"{name}, step {step + 1}")
        x = np.random.default_rng(step).standard_normal((5, 6)).astype(np.float32)
    session.lr = 1e-3  # and a step size back above 0 moves them
    session.step({"x": x}, target)
    assert all(not np.array_equal(session.state[name], before[name]) for name in tm.weights)
