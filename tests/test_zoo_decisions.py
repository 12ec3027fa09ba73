"""zoo.harness's check that a batch keeps a torch module off decisions that matter: ReLU kinks
and max-pool ties within float32 rounding whose flip moves a gradient past the zoo's tolerance."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from zoo.harness import NOISE_FACTOR, _window_top2, flip_effect, flip_fit, near_decisions, safe_attempt, window_gaps
from zoo.torch_models import BATCH, DRAWS, VISION, search_draw, symbolic_batches

import bridge


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(3, 2, 1, False), (3, 2, 0, True), (2, 2, 0, False)])
def test_window_gaps_are_each_windows_largest_minus_second_largest(kernel, stride, padding, ceil_mode):
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode)
    gaps = window_gaps(x, out, [kernel, kernel], [stride, stride], [padding, padding], 1, ceil_mode)
    _, first, second = _window_top2(x, out, [kernel, kernel], [stride, stride], [padding, padding], 1, ceil_mode)
    padded = F.pad(x, [padding] * 4, value=-torch.inf)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            window = padded[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel].flatten(2)
            top = window.topk(2, dim=2).values
            assert torch.equal(gaps[:, :, i, j], top[..., 0] - top[..., 1])
            assert torch.equal(x.flatten()[first[:, :, i, j]], top[..., 0])
            assert torch.equal(x.flatten()[second[:, :, i, j]], top[..., 1])


class _Net(torch.nn.Module):
    """relu(w * ((x0 + x1) + x2) + b), summed in that order; ``b`` None: no bias."""

    def __init__(self, bias: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.b = torch.nn.Parameter(torch.zeros(())) if bias else None

    def forward(self, x):
        y = self.w * (x[:, 0] + x[:, 1] + x[:, 2])
        return F.relu(y + self.b if self.b is not None else y)


# row 0 is 1e-8 in float64 and exactly 0 in float32 (1 + 1e-8 rounds to 1): at the kink
AT_KINK = np.array([[1.0, 1e-8, -1.0], [0.5, 0.25, 0.125]], np.float32)
OFF_KINK = np.array([[0.5, 0.25, 0.125], [0.1, 0.2, 0.3]], np.float32)
TARGET = np.array([-1.0, -1.0], np.float32)


def test_near_decisions_flags_a_functional_relu_input_within_float32_rounding_of_zero():
    hits = near_decisions(_Net(False), {"x": AT_KINK})
    assert [(where, count, effect) for where, count, _, _, effect in hits] == [(" (relu)", 1, np.inf)]
    assert near_decisions(_Net(False), {"x": OFF_KINK}) == []


def test_a_flip_matters_where_it_moves_a_gradient_past_the_tolerance():
    """Flipping row 0's ReLU adds its output cotangent (-1) to the gradient of b (-0.875 from row
    1), far past 1e-4 of it; to w's gradient it adds -1 x 1e-8, 1e-4 of its tolerance."""
    (*_, biased), = near_decisions(_Net(True), {"x": AT_KINK}, TARGET, "mse")
    (*_, scaled), = near_decisions(_Net(False), {"x": AT_KINK}, TARGET, "mse")
    assert biased > 1e3 and scaled < 1e-3


def test_safe_attempt_keeps_a_draw_whose_flips_do_not_matter_and_says_when_none_is_safe():
    draws = {0: ({"x": AT_KINK}, TARGET), 1: ({"x": OFF_KINK}, TARGET)}
    assert safe_attempt(_Net(False), draws.__getitem__, "mse") == 0
    assert safe_attempt(_Net(True), draws.__getitem__, "mse") == 1
    assert flip_effect(near_decisions(_Net(True), *draws[1], "mse")) == 0
    assert safe_attempt(_Net(True), lambda attempt: draws[0], "mse") is None


class _TwoKinks(torch.nn.Module):
    """relu(y + b) + relu(y + c) of ``_Net``'s y (w = 1): two decision calls at the same kink."""

    def __init__(self):
        super().__init__()
        self.b, self.c = torch.nn.Parameter(torch.zeros(())), torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        y = x[:, 0] + x[:, 1] + x[:, 2]
        return F.relu(y + self.b) + F.relu(y + self.c)


def test_a_limit_stops_the_flip_effects_once_they_sum_to_it():
    """Row 0 sits at both ReLUs' kink: each flip moves b's or c's gradient far past its tolerance.
    With ``limit`` the first call's effect is exact and the second is not computed (inf)."""
    full = near_decisions(_TwoKinks(), {"x": AT_KINK}, TARGET, "mse")
    stopped = near_decisions(_TwoKinks(), {"x": AT_KINK}, TARGET, "mse", limit=1.0)
    assert [count for _, count, *_ in full] == [1, 1] and all(1 < effect < np.inf for *_, effect in full)
    assert stopped[0] == full[0] and stopped[1][:4] == full[1][:4] and stopped[1][4] == np.inf
    assert near_decisions(_TwoKinks(), {"x": AT_KINK}, TARGET, "mse", limit=np.inf) == full


@pytest.mark.exhaustive  # searches draws: float64 and float32 steps of each zoo vision model, minutes
@pytest.mark.parametrize("name", sorted(VISION))
def test_the_recorded_draws_are_the_first_whose_decision_flips_stay_within_tolerance(name):
    """``DRAWS`` is what ``safe_attempt`` finds at every batch size the zoo compares ``name`` at,
    so no run searches (a new model or batch size fails here naming the entry to add)."""
    module = VISION[name](attempt=0)[0]
    found = {batch: search_draw(name, batch) for batch in (BATCH, *symbolic_batches(module))}
    recorded = {batch: DRAWS.get((name, batch), 0) for batch in found}  # None: no draw is safe
    assert found == recorded, f"{name}: DRAWS should hold {{(name, batch): attempt}} for {found}"


class _KinkCNN(torch.nn.Module):
    """relu(conv1(x0) + x1 + x2) (a 1x1 Conv, weight 1: its output is x0 exactly in float32 and
    float64; the adds in that order), then a 3x3 Conv, ReLU, mean pool and a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 1, 1, bias=False)
        self.conv2 = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.head = torch.nn.Linear(2, 3)
        with torch.no_grad():
            self.conv1.weight.fill_(1.0)

    def forward(self, x):
        pre = self.conv1(x[:, :1]) + x[:, 1:2] + x[:, 2:3]
        return self.head(F.relu(self.conv2(F.relu(pre))).mean((2, 3)))


def _kink_case(tmp_path, at_kink: bool):
    """(module, ONNX name map, inputs, target, float64 step, onnxruntime's step through bridge):
    ``at_kink`` puts row 0's first pre-activation at 1 + 1e-8 - 1 (1e-8 in float64, 0 in float32:
    the ReLU decides differently), else at 0.5."""
    from zoo.exporters import SYMBOLIC_BATCH, export
    from zoo.harness import module_oracle, name_map

    torch.manual_seed(0)
    module = _KinkCNN()
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (2, 3, 4, 4)).astype(np.float32)  # every other pre-activation >= 1.5
    x[0, :, 0, 0] = AT_KINK[0] if at_kink else [0.25, 0.125, 0.125]
    inputs, target = {"x": x}, np.array([0, 2])
    path = export(module, inputs, SYMBOLIC_BATCH, tmp_path / "kink.onnx")
    mapping, _ = name_map(module, path)
    want, _ = module_oracle(module, mapping, inputs, target, "ce", 1e-3)()
    tm = bridge.to_training_onnx(path, loss="ce", optim="adam", optim_options={"lr": 1e-3})
    return module, mapping, inputs, target, want, tm.session().step(inputs, target)


def _fit(case, got):
    module, mapping, inputs, target, want, _ = case
    # zero float32 noise: this net's float32 arithmetic error is far below 1e-4 of every gradient's scale
    return flip_fit(module, mapping, inputs, target, "ce", 1e-3, got, want, {})


def test_flip_fit_accepts_a_real_float32_decision_flip(tmp_path):
    """onnxruntime's float32 ReLU takes row 0's first input as 0 (inactive), float64 as 1e-8: conv1's
    gradient is off by that element's cotangent, past the tolerance; the fit finds that one flip
    (s = 1) and float64's step with it flipped matches onnxruntime's on every gradient and update."""
    case = _kink_case(tmp_path, at_kink=True)
    want, got = case[4], case[5]
    fit = _fit(case, got)
    assert fit.before["grad_conv1.weight"] > 10, fit
    assert fit.explains, fit
    assert [(where, at) for where, at, _ in fit.flipped] == [(" (relu)", (0,))] and abs(fit.flipped[0][2] - 1) < 1e-3
    for key in want:
        np.testing.assert_allclose(got[key], fit.record[key], rtol=1e-4, atol=1e-7, err_msg=key)
    assert not np.allclose(fit.record["updated_conv1.weight"], want["updated_conv1.weight"], rtol=1e-4, atol=0)


def test_flip_fit_settles_a_fraction_of_a_flip_only_where_it_stays_within_the_tolerance(tmp_path):
    """A step off float64 by 0.4 of the kink's flip: where the flip moves gradients by many
    tolerances that fraction is no float32 decision (NOT explained); where the tolerance is wide
    enough that the whole flip moves no gradient element past half of it (float32 noise that size),
    the fit cannot tell 0.4 from 0 and the step is float64's with nothing flipped (explained)."""
    case = _kink_case(tmp_path, at_kink=True)
    want = case[4]
    flip = {k: v - want[k] for k, v in _fit(case, case[5]).record.items() if k.startswith("grad_")}
    got = {k: want[k] + 0.4 * change for k, change in flip.items()}
    strong = _fit(case, got)
    assert not strong.explains and strong.unsettled, strong
    module, mapping, inputs, target = case[:4]
    # torch's float32 noise on each gradient: half the flip's largest change, so the flip is half the tolerance
    noise = {k: float(np.abs(change).max()) / 2 / NOISE_FACTOR for k, change in flip.items()}
    weak = flip_fit(module, mapping, inputs, target, "ce", 1e-3, got, want, noise)
    assert weak.fitted == 1 and weak.explains and weak.flipped == [] and weak.unsettled == [], weak


def test_flip_fit_rejects_a_wrong_gradient_away_from_any_decision(tmp_path):
    """With no decision near (row 0 at 0.5), onnxruntime matches float64 and nothing flips; a
    gradient element the decisions cannot move (the head's), off by 10 tolerances, or a whole
    gradient 1% off, is NOT explained (no flip may absorb it); at the kink, the real flip plus
    such an error is not explained either."""
    case = _kink_case(tmp_path, at_kink=False)
    clean = _fit(case, case[5])
    assert clean.explains and clean.flipped == [] and clean.near == 0, clean
    for wrong in ({"grad_head.weight": (0, 1), "factor": None}, {"grad_conv2.weight": None, "factor": 1.01}):
        got = {k: v.copy() for k, v in case[5].items()}
        key = next(k for k in wrong if k.startswith("grad_"))
        if wrong["factor"] is None:
            got[key][wrong[key]] += 10 * (1e-4 * np.abs(case[4][key]).max())
        else:
            got[key] *= wrong["factor"]
        assert not _fit(case, got).explains
    kink = _kink_case(tmp_path, at_kink=True)
    got = {k: v.copy() for k, v in kink[5].items()}
    got["grad_head.weight"][0, 1] += 10 * (1e-4 * np.abs(kink[4]["grad_head.weight"]).max())
    fit = _fit(kink, got)
    assert not fit.explains and fit.residual["grad_head.weight"] > 5, fit
