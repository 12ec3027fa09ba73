"""Every op-database training row compiles in onnx-mlir at its default flags (``--EmitLib -O3``) and
steps like onnxruntime.

Each row's training graph (mse + SGD, as tests/test_op_db.py converts it, for the ``onnx-mlir`` target:
the forms a user compiles for it, docs/onnx-mlir.md) is compiled by
``bridge.compile(backend="onnx-mlir")`` and one step on the same state is compared with onnxruntime at
one thread (onnx-mlir runs on one): loss, every ``grad_*``, every ``updated_*``, with the comparator and
tolerance of the IREE rows and zoo (``helpers.reference.assert_steps_match``). A row with a symbolic
batch is converted once with ``dynamic_batch=True`` and its one ``.so`` stepped at two batch sizes; every
row is also checked static. ``make test`` runs ``DEFAULT_ROWS`` (one row per op family; ``slow``, not in
``make test-fast``), the rest is ``exhaustive``. Rows onnx-mlir gets wrong are strict xfails naming the
defect and its repro in tests/repros/ (``repros.onnx_mlir_defects``), as is the graph whose two outputs
share one gradient (the zoo's resnet18 crash); docs/onnx-mlir.md lists them.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.compiled import step_mismatches
from op_db import ROWS, OpRow
from repros.onnx_mlir_defects import OP_DEFECTS
from test_op_db import OPTIONS

import bridge
from bridge.tools.target_check import onnx_mlir_missing

_MISSING = onnx_mlir_missing()
pytestmark = [pytest.mark.onnx_mlir,
              pytest.mark.skipif(_MISSING is not None, reason=f"onnx-mlir is not available: {_MISSING}")]

# One row per op family of tests/op_db.py (elementwise, activations, reductions, linear, conv, pool,
# normalization, dropout, tensor, resize, recurrent, scatter, selection, local).
DEFAULT_ROWS = {"Add-broadcast", "Relu-default", "ReduceMean-axes_keepdims1", "Gemm-bias", "Conv-2d_padded_bias",
                "MaxPool-2d_k2s2", "AveragePool-2d_k2s2", "BatchNormalization-training_mode", "Dropout-ratio_input",
                "Reshape-keep_batch", "Softmax-axis-1", "Resize-linear_half_pixel", "LSTM-forward",
                "ScatterElements-none_axis1", "TopK-largest_last_axis", "LRN-size3",
                "LayerNormalization-last_axis", "MatMul-2d_2d", "Gather-embedding"}
BATCHES = (2, 3)  # the symbolic-batch library's two batch sizes


def _params():
    rows = {row.id: row for row in ROWS if row.grad}
    for row in rows.values():
        for mode in ("static", "symbolic") if row.dynamic_batch else ("static",):
            param_id = f"{row.id}-{mode}"
            marks = [pytest.mark.slow] + ([] if row.id in DEFAULT_ROWS else [pytest.mark.exhaustive])
            if param_id in OP_DEFECTS:
                marks.append(pytest.mark.xfail(reason=OP_DEFECTS[param_id], strict=True))
            elif mode == "symbolic" and row.xfail and "dynamic" in row.xfail_checks:  # bridge's conversion fails
                marks.append(pytest.mark.xfail(reason=row.xfail, strict=True))
            yield pytest.param(row, mode, marks=marks, id=param_id)


def test_default_rows_are_rows():
    assert DEFAULT_ROWS <= {row.id for row in ROWS if row.grad}
    assert set(OP_DEFECTS) <= {f"{row.id}-{mode}" for row in ROWS for mode in ("static", "symbolic")}


def _target(tm: bridge.TrainingModel, row: OpRow, batch: int) -> np.ndarray:
    """A random float target of the graph's target shape, a symbolic dim (the batch, or an expression of
    it: ``3*batch``) at its size in the row's model at ``batch`` (``batch`` itself where that output is no
    tensor: ZipMap's sequence of maps)."""
    graph = next(i for i in tm.model.graph.input if i.name == "target").type.tensor_type.shape.dim
    output = row.model(batch).graph.output[0].type
    static = output.tensor_type.shape.dim if output.HasField("tensor_type") else [None] * len(graph)
    shape = [d.dim_value if d.HasField("dim_value") else batch if s is None and d.dim_param == "batch" else s.dim_value
             for d, s in zip(graph, static, strict=True)]
    return np.random.default_rng(batch).standard_normal(shape).astype(tm.target_dtype)


@pytest.mark.parametrize("row, mode", list(_params()))
def test_onnx_mlir_step_matches_onnxruntime(row: OpRow, mode: str):
    """One step from the initial state per batch size (the symbolic graph's one library at each of
    ``BATCHES``), onnx-mlir against onnxruntime on the same graph, state and noise inputs. Where a
    step is ill-conditioned in float32 (a sum that cancels), onnx-mlir is compared with the float64
    graph instead, within the zoo's tolerance: ``NOISE_FACTOR`` x onnxruntime's own float32 error."""
    symbolic = mode == "symbolic"
    options = dict(OPTIONS, dynamic_batch=symbolic, target="onnx-mlir", **row.convert)
    tm = bridge.to_training_onnx(row.model(), **options)
    compiled = bridge.compile(tm, backend="onnx-mlir")
    for batch in BATCHES if symbolic else BATCHES[:1]:
        inputs, target = row.inputs(batch), _target(tm, row, batch)
        ort = tm.session(threads=1)
        noise = _noise(ort.random_inputs, batch)
        feed = {**inputs, **noise}
        got = compiled.session().step(feed, target)
        want = ort.step(feed, target)
        assert set(got) == {o.name for o in tm.model.graph.output}
        mismatches = step_mismatches(row.model(), options, got, want, feed, target, f"batch {batch}")
        assert not mismatches, "\n".join(mismatches.values())


def _noise(random_inputs: dict, batch: int) -> dict[str, np.ndarray]:
    """Values for the noise inputs of random ops (``session.random_inputs``), symbolic dims at ``batch``."""
    rng = np.random.default_rng(batch)
    return {name: rng.random([d if isinstance(d, int) else batch for d in shape]).astype(dtype)
            for name, (shape, dtype) in random_inputs.items()}


_CHILD_STEP = """
import sys
import numpy as np, onnx
import bridge
from helpers.reference import assert_steps_match
model = onnx.load(sys.argv[1])
state = dict(np.load(sys.argv[2]))
session = bridge.compile(model, backend="onnx-mlir").session(state, seed=0)
ort = bridge.TrainingSession(model, state, seed=0, threads=1)
rng = np.random.default_rng(0)
inputs, target = {"x": rng.standard_normal((2, 3)).astype(np.float32)}, rng.standard_normal((2, 4)).astype(np.float32)
got = session.step(inputs, target)
assert_steps_match([got], [ort.step(inputs, target)])
del got, session
print("stepped and released")
"""


def test_outputs_sharing_one_gradient_step_and_release(tmp_path):
    """Two branches of a residual Add have one bias gradient (bridge emits ``grad_b2 = Identity(grad_b1)``,
    which onnx-mlir would return as one buffer twice): the step matches onnxruntime and the process survives
    releasing the outputs (run in a child process: an abort would end this one)."""
    import onnx
    from repros.onnx_mlir_aliased_outputs import training

    tm = training()
    onnx.save(tm.model, str(tmp_path / "train.onnx"))
    np.savez(tmp_path / "state.npz", **tm.initial_state())
    tests = str(Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", _CHILD_STEP, str(tmp_path / "train.onnx"), str(tmp_path / "state.npz")],
                            capture_output=True, text=True, cwd=tests, env={**os.environ, "PYTHONPATH": tests})
    assert result.returncode == 0 and "stepped and released" in result.stdout, result.stderr[-500:]
