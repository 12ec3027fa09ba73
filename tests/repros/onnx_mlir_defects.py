"""The onnx-mlir defects the op database meets: test param id (``<row id>-static`` or ``-symbolic``) ->
the defect and its repro in this folder. tests/test_onnx_mlir_ops.py makes each a strict xfail and
docs/op_database.py counts them in the onnx-mlir column of docs/models.md; docs/onnx-mlir.md lists them.
The ONNX node tests' failures are ``NODE_DEFECTS``."""
from __future__ import annotations

from typing import NamedTuple

OP_DEFECTS: dict[str, str] = {}  # bridge emits a form avoiding each defect met so far (docs/onnx-mlir.md)


class NodeCause(NamedTuple):
    """Why a node test's training graph fails in onnx-mlir (tests/test_onnx_node_suite.py): the defect, and
    the repro script in this folder that shows it (listed in docs/onnx-mlir.md's table), or None with a
    reason where the failure is not onnx-mlir's."""

    reason: str
    repro: str | None


# ONNX node test name -> the cause of its recorded onnx-mlir failure (tests/onnx_node_expectations.json).
NODE_DEFECTS: dict[str, NodeCause] = {
    "test_nllloss_NCd1d2d3d4d5_mean_weight_expanded": NodeCause(
        "onnx-mlir's ReduceSum is a sequential float32 sum: the loss (6480 terms) and grad_weight, which "
        "divides by a sum, are further from float64 than 4 x onnxruntime's error", "onnx_mlir_reduce_sum_sequential.py"),
}


def compile_as_is(model, folder: str, flags: tuple[str, ...] = ()) -> str:
    """``model`` compiled by ``onnx-mlir --EmitLib -O3`` (and further ``flags``) without bridge.compile's rewrites
    (which avoid the defects shown here): the path of the library written in ``folder``."""
    import os
    import subprocess

    import onnx

    from bridge.training.runtime_onnx_mlir import find_onnx_mlir

    source = os.path.join(folder, "model.onnx")
    onnx.save(model, source)
    subprocess.run([str(find_onnx_mlir().compiler), "--EmitLib", "-O3", *flags, source, "-o", os.path.join(folder, "model")],
                   check=True, capture_output=True)
    return os.path.join(folder, "model.so")
