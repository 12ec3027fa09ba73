"""Render the op-database table of docs/models.md from the rows of tests/op_db.py.

Every status comes from the rows (their ``grad``, ``dynamic_batch``, ``iree`` and ``xfail``
fields), not from a test run, so the table is deterministic; tests/test_op_db.py proves each
"yes" (and a strict xfail fails the run when a known failure starts passing); the onnx-mlir column is
each row compiled by onnx-mlir (tests/test_onnx_mlir_ops.py, its defects in tests/repros/onnx_mlir_defects.py). Run:
``.venv/bin/python docs/op_database.py`` rewrites the block between the markers (tests/test_op_db.py
checks that the doc is current).
"""
from __future__ import annotations

import sys
from itertools import groupby
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from op_db import ROWS, OpRow  # noqa: E402
from repros.onnx_mlir_defects import OP_DEFECTS  # noqa: E402

BEGIN, END = "<!-- op database: begin -->", "<!-- op database: end -->"
COLUMNS = ("forward", "gradient", "onnx-mlir", "dynamic batch", "IREE")


def _status(row: OpRow, column: str) -> str:
    """yes / xfail / n/a (no trainable path) / no (not applicable to this variant) for one row."""
    if column == "forward":
        return "xfail" if row.xfail and "forward" in row.xfail_checks else "yes"
    if not row.grad:
        return "n/a"
    check = {"gradient": "training", "onnx-mlir": "training", "dynamic batch": "dynamic", "IREE": "iree"}[column]
    if column == "dynamic batch" and not row.dynamic_batch or column == "IREE" and not row.iree:
        return "no"
    if column == "onnx-mlir" and _onnx_mlir_defects(row):  # compiled: tests/test_onnx_mlir_ops.py
        return "xfail"
    return "xfail" if row.xfail and check in row.xfail_checks else "yes"


def _summary(rows: list[OpRow], column: str) -> str:
    """``yes`` when every variant is, else the count of each status."""
    statuses = [_status(r, column) for r in rows]
    if len(set(statuses)) == 1:
        return statuses[0]
    return ", ".join(f"{statuses.count(s)} {s}" for s in ("yes", "xfail", "no", "n/a") if s in statuses)


def _onnx_mlir_defects(row: OpRow) -> list[str]:
    """The onnx-mlir defects the row's compiled step meets (static, symbolic batch)."""
    return sorted({OP_DEFECTS[f"{row.id}-{mode}"] for mode in ("static", "symbolic") if f"{row.id}-{mode}" in OP_DEFECTS})


def _failures(rows: list[OpRow]) -> str:
    notes = [f"{r.variant}: {r.xfail}" for r in rows if r.xfail] + [f"{r.variant}: {d}" for r in rows for d in _onnx_mlir_defects(r)]
    return "; ".join(notes).replace("|", "\\|") or "-"


def table() -> str:
    lines = [BEGIN, "", f"| ONNX op | variants | {' | '.join(COLUMNS)} | known failures |",
             "| --- | --- |" + " --- |" * len(COLUMNS) + " --- |"]
    by_op = sorted(ROWS, key=lambda r: r.op_type)
    for op_type, group in groupby(by_op, key=lambda r: r.op_type):
        rows = list(group)
        variants = ", ".join(r.variant for r in rows)
        cells = " | ".join(_summary(rows, c) for c in COLUMNS)
        lines.append(f"| {op_type} | {variants} | {cells} | {_failures(rows)} |")
    ops = len({r.op_type for r in ROWS})
    xfails = sum(1 for r in ROWS if r.xfail)
    trained = [r for r in ROWS if r.grad]
    defects = sum(1 for r in trained if _onnx_mlir_defects(r))
    lines += ["", f"{ops} op types, {len(ROWS)} rows, {xfails} with a known failure; onnx-mlir compiles and steps "
                  f"{len(trained)} training rows, {defects} of them meeting an onnx-mlir defect.", "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    from blocks import write_block

    write_block(Path(__file__).with_name("models.md"), BEGIN, END, table())
