"""The zoo's comparison cannot pass a wrong first step: NaN never matches, elements allowed to miss
the tolerance are still bounded, a step off the oracle passes only as float64's up to proven
decision flips; a loss that does not fall fails."""
from __future__ import annotations

import numpy as np
import pytest
from zoo.harness import LOSS_STEPS, MIN_STEPS, MISMATCH_BOUND, Case, FlipFit, assert_first_step, assert_loss_falls, check_batch


def _case(allowed_mismatch: float) -> Case:
    return Case("probe", "unused.onnx", {}, np.zeros(1), "mse", set(), oracle=lambda: ({}, {}),
                rtol=1e-4, allowed_mismatch=allowed_mismatch)


@pytest.mark.parametrize("allowed_mismatch", [0.0, 0.5])
def test_nan_never_matches(allowed_mismatch):
    want = {"grad_w": np.array([1.0, np.nan, 2.0, 3.0], np.float32)}
    got = {"grad_w": np.array([1.0, np.nan, 2.0, 3.0], np.float32)}
    with pytest.raises(AssertionError, match="non-finite"):
        assert_first_step(_case(allowed_mismatch), got, want, {}, {})


def test_allowed_mismatch_is_bounded():
    want = {"grad_w": np.arange(1.0, 101.0, dtype=np.float32)}
    close = {"grad_w": want["grad_w"] * np.float32(1 + MISMATCH_BOUND / 4)}  # within the bound
    assert_first_step(_case(1.0), close, want, {}, {})
    far = {"grad_w": want["grad_w"].copy()}
    far["grad_w"][0] += 2 * MISMATCH_BOUND * 100  # one element twice the bound away
    with pytest.raises(AssertionError, match="of the tensor's scale away"):
        assert_first_step(_case(0.5), far, want, {}, {})


def test_exact_tolerance_without_allowed_mismatch():
    want = {"grad_w": np.arange(1.0, 101.0, dtype=np.float32)}
    got = {"grad_w": want["grad_w"].copy()}
    got["grad_w"][5] *= 1.01
    with pytest.raises(AssertionError):
        assert_first_step(_case(0.0), got, want, {}, {})


class _Converted:
    """A stand-in for a converted model whose every step returns ``outputs``."""

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def session(self):
        return self

    def step(self, inputs, target):
        return self.outputs

    def initial_state(self):
        return {}


def _fit(explains: bool, record: dict) -> FlipFit:
    """A ``flip_fit`` answer: one settled flip (or one unsettled), the flipped float64 step ``record``."""
    flip = [("layer (relu)", (0,), 1.0 if explains else 0.5)]
    return FlipFit(flip if explains else [], [] if explains else flip, {"grad_w": 50.0}, {"grad_w": 0.0}, record, 1, 1)


def _batch_case(explain) -> Case:
    want = {"grad_w": np.arange(1.0, 101.0, dtype=np.float32)}
    return Case("probe", "unused.onnx", {"x": np.zeros((2, 3), np.float32)}, np.zeros(2, np.int64), "ce", set(),
                oracle=lambda: ({}, {}), rtol=1e-4, rebatch=lambda inputs, target: lambda: (want, {}), explain=explain)


def test_a_failing_batch_passes_only_as_float64_up_to_proven_flips():
    """Off the oracle at a batch size: ``check_batch`` asks ``flip_fit`` and passes only where the fit
    settles (coefficients 0 or 1) and the step matches the flipped float64 step exactly as tightly."""
    got = {"grad_w": np.arange(1.0, 101.0, dtype=np.float32)}
    got["grad_w"][7] += 5  # one element far off: a flipped decision, or a defect
    asked = []

    def explains(inputs, target, step, want, noise):
        asked.append(len(target))
        return _fit(True, {"grad_w": got["grad_w"].copy()})

    check_batch(_batch_case(explains), _Converted(got), 16)
    assert asked == [16]
    unsettled = _batch_case(lambda *args: _fit(False, {"grad_w": got["grad_w"].copy()}))
    with pytest.raises(AssertionError, match="not torch float64's step up to near-decision flips"):
        check_batch(unsettled, _Converted(got), 16)
    elsewhere = {"grad_w": got["grad_w"].copy()}
    elsewhere["grad_w"][9] += 5  # the flipped step explains element 7 but not this one
    with pytest.raises(AssertionError, match="vs float64 with its flips"):
        check_batch(_batch_case(lambda *args: _fit(True, {"grad_w": got["grad_w"].copy()})), _Converted(elsewhere), 16)


def test_without_an_explanation_a_failing_batch_fails():
    got = {"grad_w": np.arange(1.0, 101.0, dtype=np.float32) * np.float32(1.01)}  # 1% off everywhere
    with pytest.raises(AssertionError, match="batch16"):
        check_batch(_batch_case(None), _Converted(got), 16)


class _Losses:
    """A stand-in session whose steps return the losses given, in turn."""

    def __init__(self, losses):
        self.losses = iter(losses)

    def step(self, inputs, target):
        return {"loss": np.float32(next(self.losses))}


def test_the_loss_must_fall_by_10_percent_within_its_steps():
    case = _case(0.0)
    with pytest.raises(AssertionError, match="did not fall"):
        assert_loss_falls(case, _Losses([0.95] * LOSS_STEPS), 1.0)  # 5% only
    assert len(assert_loss_falls(case, _Losses([1.0] * (LOSS_STEPS - 2) + [0.5]), 1.0)) == LOSS_STEPS  # the last step
    assert len(assert_loss_falls(case, _Losses([0.5] * LOSS_STEPS), 1.0)) == MIN_STEPS  # the state fed back twice
    assert len(assert_loss_falls(case, _Losses([1.0] * 9 + [0.8] * 30), 1.0)) == 11  # stops once it has fallen
