"""Render the zoo's onnx-mlir table of docs/models.md: each zoo model of tests/test_onnx_mlir_zoo.py, static
and symbolic batch, with what onnx-mlir did with it.

A param's result is ``make test`` when CI runs it (``DEFAULT``), a strict xfail with its defect (``XFAIL``),
the outcome recorded in tests/onnx_mlir_zoo_results.json from a run of the exhaustive tier (each entry:
the result, and the compile and step figures of that run), else "not run". Run:
``.venv/bin/python docs/onnx_mlir_zoo.py`` rewrites the block between the markers
(tests/test_zoo_docs.py checks that the doc is current).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

BEGIN, END = "<!-- onnx-mlir zoo: begin -->", "<!-- onnx-mlir zoo: end -->"
RESULTS = TESTS / "onnx_mlir_zoo_results.json"
MODES = {"static": "static batch", "dynamic": "symbolic batch"}


def results() -> dict[str, dict]:
    """Param id -> the recorded run of the exhaustive tier (tests/onnx_mlir_zoo_results.json)."""
    return json.loads(RESULTS.read_text())


def outcome(param_id: str) -> str:
    """What the doc says of one param: ``pass (make test)``, ``pass``, ``xfail: <defect>``, ``fail: <what>`` or ``not run``."""
    from test_onnx_mlir_zoo import DEFAULT, XFAIL

    if param_id in XFAIL:
        return f"xfail: {XFAIL[param_id]}"
    if param_id in DEFAULT:
        return "pass (make test)"
    return results().get(param_id, {}).get("result", "not run")


def table() -> str:
    from zoo.compiled import zoo_params

    models: dict[tuple[str, str], dict[str, str]] = {}
    for param in zoo_params():
        kind, name, mode = param.values
        models.setdefault((kind, name), {})[mode] = outcome(param.id)
    lines = [BEGIN, "", "| source | model | " + " | ".join(MODES.values()) + " |", "| --- | --- | --- | --- |"]
    for (kind, name), found in models.items():
        lines.append(f"| {kind} | {name} | " + " | ".join(found.get(mode, "-") for mode in MODES) + " |")
    cells = [cell for found in models.values() for cell in found.values()]
    passed = sum(cell.startswith("pass") for cell in cells)
    xfailed = sum(cell.startswith("xfail") for cell in cells)
    failed = sum(cell.startswith("fail") for cell in cells)
    lines += ["", f"{len(cells)} cases: {passed} pass, {xfailed} strict xfail, {failed} failed (cause not yet found), "
              f"{len(cells) - passed - xfailed - failed} not run.",
              "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    from blocks import write_block

    write_block(Path(__file__).with_name("models.md"), BEGIN, END, table())
