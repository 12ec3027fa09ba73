"""The ONNX backend node tests (the subset of tests/onnx_node_suite.py) hold their recorded verdicts.

``tests/onnx_node_expectations.json`` records, per test, bridge's forward verdict, onnxruntime's,
the gradient verdict and the onnx-mlir verdict (the training graph compiled by onnx-mlir, its step
against onnxruntime's). Any change fails, a fix as much as a regression (like a strict xfail):
after a fix, rewrite the file with ``BRIDGE_UPDATE_EXPECTATIONS=1 pytest tests/test_onnx_node_suite.py``
(the tests then record instead of compare; ``make test-all`` tier for every gradient) or with
``PYTHONPATH=. python tests/onnx_node_suite.py``, and regenerate docs/models.md with ``docs/conformance.py``.

Forward verdicts run in every tier; gradient verdicts are ``exhaustive`` (``make test-all``) except
for ``GRADIENT_SAMPLE``, one test per op family (``make test``), of which ``make test-fast`` runs
``GRADIENT_FAST``. onnx-mlir verdicts are ``exhaustive``, skipped where onnx-mlir is not installed.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnx_node_suite as suite
import pytest
from generated_docs import assert_generated_block_current
from repros.onnx_mlir_defects import NODE_DEFECTS

from bridge.tools.target_check import onnx_mlir_missing

# One pytest-xdist work unit (tests/conftest.py): every process that runs one of these tests first
# builds the suite's cases (``suite.cases()``, ~8 s of CPU); grouped, one worker builds them.
pytestmark = pytest.mark.xdist_group("onnx_node_suite")

UPDATE = os.environ.get("BRIDGE_UPDATE_EXPECTATIONS") == "1"
ONNX_MLIR_MISSING = onnx_mlir_missing()
EXPECTED = suite.load_expectations()
NAMES = sorted(EXPECTED)

# One gradient case per op family, run in the default tier.
GRADIENT_SAMPLE = frozenset({
    "test_abs", "test_acos", "test_acosh", "test_add", "test_asin", "test_asinh", "test_atan_example",
    "test_atanh", "test_averagepool_2d_ceil", "test_basic_conv_with_padding", "test_clip_default_max_expanded",
    "test_concat_1d_axis_0", "test_convtranspose_1d", "test_cos", "test_cosh", "test_cumsum_1d", "test_div",
    "test_elu", "test_erf", "test_exp_example", "test_expand_dim_changed", "test_gather_1",
    "test_gather_elements_0", "test_gathernd_example_float32", "test_gelu_default_1",
    "test_gemm_all_attributes", "test_globalaveragepool_precomputed", "test_globalmaxpool_precomputed",
    "test_group_normalization_epsilon_expanded", "test_gru_defaults", "test_hardsigmoid",
    "test_hardswish_expanded", "test_instancenorm_epsilon", "test_l1normalization_axis_0",
    "test_layer_normalization_2d_axis0", "test_leakyrelu", "test_log", "test_logsoftmax_axis_0",
    "test_lstm_batchwise", "test_matmul_2d", "test_max_float32",
    "test_maxpool_2d_ceil_output_size_reduce_by_one", "test_mean_one_input", "test_min_example", "test_mish",
    "test_mul", "test_mvn", "test_neg", "test_pow_example", "test_prelu_example", "test_reciprocal",
    "test_reduce_l1_default_axes_keepdims_example", "test_reduce_l2_default_axes_keepdims_example",
    "test_reduce_max_default_axes_keepdim_example", "test_reduce_mean_default_axes_keepdims_example",
    "test_reduce_min_default_axes_keepdims_random", "test_reduce_prod_default_axes_keepdims_example",
    "test_reduce_sum_default_axes_keepdims_example", "test_reduce_sum_square_default_axes_keepdims_example",
    "test_relu", "test_resize_downsample_scales_cubic_A_n0p5_exclude_outside", "test_selu",
    "test_shrink_soft_expanded_ver18", "test_sigmoid_example", "test_simple_rnn_batchwise", "test_sin",
    "test_sinh_example", "test_slice_default_steps", "test_softmax_axis_0", "test_softplus_example",
    "test_softsign_example", "test_split_1d_uneven_split_opset18", "test_sqrt", "test_sub",
    "test_sum_two_inputs", "test_tan_example", "test_tanh", "test_thresholdedrelu", "test_tile_precomputed",
    "test_upsample_nearest", "test_where_example",
})

_recorded: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_recorded():
    """In update mode, merge what the tests recorded into the expectations file."""
    yield
    if UPDATE and _recorded:
        merged = suite.load_expectations()
        for name, entry in _recorded.items():
            merged.setdefault(name, {}).update(entry)
        suite.write_expectations(merged)


def _check(name: str, got: dict[str, object]) -> None:
    if UPDATE:
        _recorded.setdefault(name, {}).update(got)
        return
    want = {key: EXPECTED[name].get(key) for key in got}
    assert got == want, (f"{name}: verdicts changed {want} -> {got}; if this is a fix, update "
                         "tests/onnx_node_expectations.json (BRIDGE_UPDATE_EXPECTATIONS=1)")


def test_expectations_cover_the_subset():
    """The expectations file names exactly the selected tests (a new onnx version changes both)."""
    selected = set(suite.cases())
    if UPDATE:
        for name in selected - set(EXPECTED):
            _recorded[name] = suite.verdicts(name)
        return
    assert selected == set(EXPECTED), (
        f"missing: {sorted(selected - set(EXPECTED))[:10]}, stale: {sorted(set(EXPECTED) - selected)[:10]}")


@pytest.mark.parametrize("name", NAMES)
def test_forward(name):
    """bridge's importer and onnxruntime against the test's expected outputs."""
    _check(name, suite.forward_verdicts(name))


# The gradient cases of make test-fast: a thin slice of GRADIENT_SAMPLE (tests/test_op_db.py runs a
# training step of every op there); make test and CI run the whole sample.
GRADIENT_FAST = frozenset({
    "test_add", "test_basic_conv_with_padding", "test_gemm_all_attributes", "test_lstm_batchwise",
    "test_maxpool_2d_ceil_output_size_reduce_by_one", "test_softmax_axis_0", "test_layer_normalization_2d_axis0",
    "test_reduce_mean_default_axes_keepdims_example", "test_gather_1", "test_slice_default_steps",
})


def _gradient_tier(name: str):
    if name in GRADIENT_FAST:
        return ()
    return pytest.mark.slow if name in GRADIENT_SAMPLE else pytest.mark.exhaustive


@pytest.mark.parametrize("name", [pytest.param(n, marks=_gradient_tier(n)) for n in NAMES])
def test_gradient(name):
    """One mse + SGD step against float64 finite differences (helpers/oracle.py)."""
    _check(name, {"grad": suite.grad_verdict(name)})


def test_gradient_sample_is_gradient_cases():
    """The default-tier sample holds only tests that reach a gradient verdict, one per op family."""
    families = [EXPECTED[n]["family"] for n in GRADIENT_SAMPLE]
    assert len(families) == len(set(families))
    assert all(not EXPECTED[n]["grad"].startswith("n/a") for n in GRADIENT_SAMPLE)
    assert GRADIENT_FAST <= GRADIENT_SAMPLE


@pytest.mark.onnx_mlir
@pytest.mark.exhaustive
@pytest.mark.skipif(ONNX_MLIR_MISSING is not None, reason=f"onnx-mlir is not available: {ONNX_MLIR_MISSING}")
@pytest.mark.parametrize("name", NAMES)
def test_onnx_mlir(name):
    """The training graph compiled by onnx-mlir steps like onnxruntime (``suite.onnx_mlir_verdict``)."""
    _check(name, {"onnx_mlir": suite.onnx_mlir_verdict(name)})


def test_onnx_mlir_failures_name_their_cause():
    """Every onnx-mlir failure recorded has its cause in ``NODE_DEFECTS`` (a defect of docs/onnx-mlir.md's
    table and its repro, or why bridge's graph is at fault), and every cause listed is a recorded failure."""
    failing = {n for n in NAMES if (EXPECTED[n].get("onnx_mlir") or "").startswith("fail")}
    assert failing == set(NODE_DEFECTS)
    table = (Path(__file__).parent.parent / "docs" / "onnx-mlir.md").read_text()
    for cause in set(NODE_DEFECTS.values()):
        assert cause.repro is None or (Path(__file__).parent / "repros" / cause.repro).exists(), cause
        assert cause.repro is None or f"`{cause.repro}`" in table, f"{cause.repro} is not in docs/onnx-mlir.md's table"


@pytest.mark.onnx_mlir
@pytest.mark.slow
@pytest.mark.skipif(ONNX_MLIR_MISSING is not None, reason=f"onnx-mlir is not available: {ONNX_MLIR_MISSING}")
def test_reduce_sum_repro_shows_a_sequential_sum():
    """The repro of the one failure's cause: onnx-mlir's ReduceSum is the sequential float32 sum, bit for
    bit, and further from the float64 sum than onnxruntime's (when onnx-mlir changes, its row must too)."""
    from repros.onnx_mlir_reduce_sum_sequential import relative_errors

    found = relative_errors()
    assert found["onnx-mlir is the sequential sum"] == 1.0
    assert found["onnx-mlir"] > 2 * found["onnxruntime"]


def test_no_recorded_gradient_is_wrong():
    """Every gradient verdict that reached its oracle agrees with it (finite differences; torch at kinks)."""
    assert [n for n in NAMES if suite.wrong_gradient(EXPECTED[n]["grad"] or "")] == []


def test_conformance_doc_current():
    assert_generated_block_current("conformance.py", "models.md", "render")
