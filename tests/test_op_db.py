"""Every registered converter driven through the whole training path, one row of tests/op_db.py
at a time: forward (bridge's importer vs onnxruntime), one training step (float64 vs finite
differences of the source model, float32 vs float64, onnx-mlir's op table: one variant per op in
``make test-fast``, all in ``make test``), a symbolic batch (equal to the static conversions at
batch 1 and 3: a sample of ops in ``make test-fast``, one variant per op in ``make test``, all in
``make test-all``) and IREE (a sample in ``make test``, every row in ``make test-all``)."""
from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from generated_docs import assert_generated_block_current
from helpers.importer import import_and_run, run_onnxruntime
from helpers.oracle import FLOAT32_EPS, FLOAT32_ULPS, LR, _random_noise, check_training_step, run_reference, step_outputs
from helpers.reference import assert_steps_match
from op_db import ROWS, OpRow
from wild.oracle import maps_as_rows

import bridge
from bridge.pipeline.importer.registry import CONVERTERS, import_all_converters
from bridge.tools.verify import scale_of as _scale

OPTIONS = {"loss": "mse", "optim": "sgd", "optim_options": {"lr": LR}}
FLOAT32_BOUND = FLOAT32_ULPS * FLOAT32_EPS  # of a tensor's scale: float32 results vs each other
DYNAMIC_BATCHES = (1, 3)
# Ops whose symbolic batch make test-fast checks (every op's in make test): shapes computed from
# the batch (Reshape, Flatten, Expand, Slice, Pad, Resize), batch-wide reductions and statistics
# (ReduceMean, Softmax, BatchNormalization, LayerNormalization), the layers of most models (Gemm,
# MatMul, Conv, MaxPool, AveragePool, Gather) and a recurrence (LSTM).
DYNAMIC_FAST = {"Reshape", "Flatten", "Expand", "Slice", "Pad", "Resize", "ReduceMean", "Softmax",
                "BatchNormalization", "LayerNormalization", "Gemm", "MatMul", "Conv", "MaxPool", "AveragePool",
                "Gather", "LSTM", "Concat", "Transpose", "Relu"}
# Rows compiled by IREE in the slow run (make test); the others are exhaustive (make test-all).
IREE_SAMPLE = {"Conv-2d_padded_bias", "MaxPool-2d_k2s2", "Softmax-axis-1", "LSTM-forward", "Resize-linear_half_pixel"}


def _params(rows, check: str):
    """One pytest param per row; known failures as strict xfails."""
    for row in rows:
        marks = [pytest.mark.xfail(reason=row.xfail, strict=True)] if row.xfail and check in row.xfail_checks else []
        yield pytest.param(row, id=row.id, marks=marks)


def assert_close_float32(got, want, what: str) -> None:
    """Equal within the float32 bound of the tensor's scale (exactly for integers and booleans)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    error = float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))
    assert error <= FLOAT32_BOUND * max(_scale(want), 1.0), f"{what}: error {error:.3g}, scale {_scale(want):.3g}"


def _ort_or_reference(model, feed) -> list[np.ndarray]:
    """The source model in onnxruntime, or ONNX's reference evaluator where onnxruntime has no kernel."""
    try:
        return run_onnxruntime(model, feed)
    except onnxruntime.capi.onnxruntime_pybind11_state.Fail as exc:  # e.g. RNN layout=1
        if "not supported" not in str(exc):
            raise
    except onnxruntime.capi.onnxruntime_pybind11_state.NotImplemented:
        pass
    return run_reference(model, feed)


def test_every_converter_has_a_row_and_every_row_a_converter():
    import_all_converters()
    rows = {row.op_type for row in ROWS}
    assert sorted(set(CONVERTERS) - rows) == [], "converters without an op_db row"
    assert sorted(rows - set(CONVERTERS)) == [], "op_db rows of ops with no converter"
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    assert DYNAMIC_FAST <= {row.op_type for row in ROWS if row.dynamic_batch}, "DYNAMIC_FAST names an op without a row"


@pytest.mark.parametrize("row", list(_params(ROWS, "forward")))
def test_forward_matches_onnxruntime(row: OpRow):
    model, feed = row.model(), row.inputs()
    got, want = import_and_run(model, feed), [maps_as_rows(w) for w in _ort_or_reference(model, feed)]
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close_float32(g, w, f"{row.id} output {index}")


def _representatives(rows) -> dict[str, OpRow]:
    """Per op type, its first row without a known failure (else its first row)."""
    first: dict[str, OpRow] = {}
    for row in rows:
        if row.op_type not in first or first[row.op_type].xfail and not row.xfail:
            first[row.op_type] = row
    return first


def _training_params():
    """Every row with a gradient; in ``make test-fast`` one per op (its representative), the other
    variants ``slow`` (``make test`` and CI run every row)."""
    rows = [r for r in ROWS if r.grad]
    fast = _representatives(rows)
    for param in _params(rows, "training"):
        row = param.values[0]
        tier = [] if fast[row.op_type] is row else [pytest.mark.slow]
        yield pytest.param(row, id=param.id, marks=[*param.marks, *tier])


@pytest.mark.parametrize("row", list(_training_params()))
def test_training_step_matches_finite_differences(row: OpRow):
    result = check_training_step(row.model(), row.inputs(), reference=row.oracle_model(), twin=row.twin,
                                 dynamic_batch=False, **row.convert)
    assert sorted(result.weights) == sorted(row.weights)
    assert result.failures() == []


def _step(tm: bridge.TrainingModel, row: OpRow, batch: int, static: bridge.TrainingModel) -> dict[str, np.ndarray]:
    """One float32 step at ``batch`` (target and Dropout noise drawn for the static model)."""
    inputs = row.inputs(batch)
    target = np.random.default_rng(batch).standard_normal(static.target_shape).astype(np.float32)
    noise = {k: v.astype(np.float32) for k, v in _random_noise(static, inputs, batch).items()}
    return step_outputs(tm, inputs, target, noise)


def _dynamic_params():
    """Every dynamic row: one per op (its representative) in ``make test`` and CI, the other variants
    ``exhaustive``; ``make test-fast`` runs the representatives of ``DYNAMIC_FAST`` only."""
    rows = [r for r in ROWS if r.grad and r.dynamic_batch]
    default = _representatives(rows)
    for param in _params(rows, "dynamic"):
        row = param.values[0]
        if default[row.op_type] is not row:
            tier = [pytest.mark.exhaustive]
        else:
            tier = [] if row.op_type in DYNAMIC_FAST else [pytest.mark.slow]
        yield pytest.param(row, id=param.id, marks=[*param.marks, *tier])


@pytest.mark.parametrize("row", list(_dynamic_params()))
def test_dynamic_batch_equals_static_conversions(row: OpRow):
    dynamic = bridge.to_training_onnx(row.model(), dynamic_batch=True, **OPTIONS, **row.convert)
    for name in dynamic.data_inputs:
        graph_input = next(i for i in dynamic.model.graph.input if i.name == name)
        assert graph_input.type.tensor_type.shape.dim[0].dim_param == "batch", name
    for batch in DYNAMIC_BATCHES:
        static = bridge.to_training_onnx(row.model(batch), dynamic_batch=False, **OPTIONS, **row.convert)
        got, want = _step(dynamic, row, batch, static), _step(static, row, batch, static)
        assert set(got) == set(want)
        for key in want:
            assert_close_float32(got[key], want[key], f"batch {batch}: {key}")


@pytest.mark.xfail(strict=True, reason="symbolic batch: mse's 1/numel is computed in float32 (sym_float) and "
                                       "cast to double, so a float64 graph's gradients carry float32 rounding")
def test_float64_dynamic_batch_gradients_match_finite_differences():
    row = next(r for r in ROWS if r.id == "Relu-default")
    assert check_training_step(row.model(), row.inputs(), dynamic_batch=True).failures() == []


def _iree_params():
    for param in _params([r for r in ROWS if r.grad and r.iree], "iree"):
        row = param.values[0]
        tier = [] if row.id in IREE_SAMPLE else [pytest.mark.exhaustive]
        yield pytest.param(row, id=param.id, marks=[*param.marks, *tier])


@pytest.mark.slow
@pytest.mark.iree
@pytest.mark.parametrize("row", list(_iree_params()))
def test_iree_step_matches_onnxruntime(row: OpRow):
    tm = bridge.to_training_onnx(row.model(), dynamic_batch=False, **OPTIONS, **row.convert)
    inputs = row.inputs()
    target = np.random.default_rng(0).standard_normal(tm.target_shape).astype(np.float32)
    iree = bridge.compile(tm, backend="iree").session(seed=0)
    ort = bridge.TrainingSession(tm.model, tm.initial_state(), seed=0)  # the same Dropout noise
    assert_steps_match([iree.step(inputs, target)], [ort.step(inputs, target)])


def test_op_database_doc_is_current():
    assert_generated_block_current("op_database.py", "models.md", "table")
