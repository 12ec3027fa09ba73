"""Render the ONNX-conformance section of docs/models.md from tests/onnx_node_expectations.json.

The verdicts are those recorded by tests/test_onnx_node_suite.py (see tests/onnx_node_suite.py
for what each one means); this script only counts them, so its output is deterministic. Run
``.venv/bin/python docs/conformance.py`` to rewrite the section in place
(tests/test_onnx_node_suite.py checks that it is current).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from onnx_node_suite import wrong_gradient  # noqa: E402

ROOT = Path(__file__).parent.parent
EXPECTATIONS = ROOT / "tests" / "onnx_node_expectations.json"
DOC = Path(__file__).parent / "models.md"
BEGIN, END = "<!-- conformance: begin -->", "<!-- conformance: end -->"


def _load() -> dict[str, dict]:
    return json.loads(EXPECTATIONS.read_text())


def _gradient_case(entry: dict) -> bool:
    return not entry["grad"].startswith("n/a")


def _mlir_checked(entry: dict) -> bool:
    """The float32 training graph was built and checked against onnx-mlir's table."""
    return _gradient_case(entry) and not entry["grad"].startswith("fail: crash")


def _mlir_clean(entry: dict) -> bool:
    return _mlir_checked(entry) and "onnx-mlir:" not in entry["grad"]


def _mlir_stepped(entry: dict) -> bool:
    """The training graph was compiled by onnx-mlir and stepped against onnxruntime (a verdict not n/a)."""
    return not (entry.get("onnx_mlir") or "n/a").startswith("n/a")


def _mlir_step_failures(entries) -> str:
    """The onnx-mlir step failures by kind (compile, step, mismatch), or nothing."""
    kinds = defaultdict(int)
    for entry in entries:
        if entry["onnx_mlir"].startswith("fail"):
            kinds[entry["onnx_mlir"].split(":")[1].strip()] += 1
    return "; ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))


def _percent(part: int, whole: int) -> str:
    return f"{part} / {whole} ({100 * part / whole:.0f}%)" if whole else "0 / 0"


def _passes(entries, key: str) -> int:
    return sum(e[key] == "pass" for e in entries)


def totals(tests: dict[str, dict]) -> list[str]:
    """The summary table: bridge vs onnxruntime forward, gradients."""
    imported = [e for e in tests.values() if e["forward"] != "unsupported"]
    grads = [e for e in tests.values() if _gradient_case(e)]
    not_applicable = sum(e["grad"].startswith("n/a") and e["forward"] == "pass" for e in tests.values())
    stepped = [e for e in tests.values() if _mlir_stepped(e)]
    return [
        "| measure | result |", "| --- | --- |",
        f"| bridge forward, all tests | {_percent(_passes(tests.values(), 'forward'), len(tests))} |",
        f"| onnxruntime forward, all tests | {_percent(_passes(tests.values(), 'onnxruntime'), len(tests))} |",
        f"| bridge forward, tests whose ops bridge imports | {_percent(_passes(imported, 'forward'), len(imported))} |",
        f"| onnxruntime forward, the same tests | {_percent(_passes(imported, 'onnxruntime'), len(imported))} |",
        f"| gradient, gradient cases (forward passes) | {_percent(_passes(grads, 'grad'), len(grads))} |",
        f"| wrong gradients (vs finite differences; vs torch at kinks) | {sum(wrong_gradient(e['grad']) for e in grads)} |",
        f"| no gradient case although the forward passes | {not_applicable} |",
        f"| training graph onnx-mlir clean, of those built | {_percent(sum(map(_mlir_clean, grads)), sum(map(_mlir_checked, grads)))} |",
        f"| onnx-mlir step matches onnxruntime, training graphs built | {_percent(_passes(stepped, 'onnx_mlir'), len(stepped))} |",
        f"| onnx-mlir failures (compile; step; mismatch) | {_mlir_step_failures(stepped) or 0} |",
    ]


def per_op(tests: dict[str, dict]) -> list[str]:
    """One row per op family: tests, forward passes, gradient passes, onnx-mlir clean, onnx-mlir steps."""
    families: dict[str, list[dict]] = defaultdict(list)
    for entry in tests.values():
        families[entry["family"]].append(entry)
    lines = ["| op | tests | forward pass | gradient pass | onnx-mlir clean | onnx-mlir step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for op in sorted(families):
        entries = families[op]
        grads = [e for e in entries if _gradient_case(e)]
        forward = "unsupported" if all(e["forward"] == "unsupported" for e in entries) else \
            f"{sum(e['forward'] == 'pass' for e in entries)}"
        gradient = f"{sum(e['grad'] == 'pass' for e in grads)} / {len(grads)}" if grads else "-"
        checked = [e for e in grads if _mlir_checked(e)]
        clean = f"{sum(map(_mlir_clean, checked))} / {len(checked)}" if checked else "-"
        stepped = [e for e in entries if _mlir_stepped(e)]
        step = f"{_passes(stepped, 'onnx_mlir')} / {len(stepped)}" if stepped else "-"
        lines.append(f"| {op} | {len(entries)} | {forward} | {gradient} | {clean} | {step} |")
    return lines


def spec_disagreements(tests: dict[str, dict]) -> list[str]:
    """Tests where onnxruntime's outputs differ from the spec's expected ones."""
    lines = []
    for name, entry in sorted(tests.items()):
        if entry["onnxruntime"] != "pass":
            lines.append(f"- `{name}`: onnxruntime {entry['onnxruntime'].removeprefix('fail: ')}; "
                         f"bridge {entry['forward']}")
    return lines


def render() -> str:
    tests = _load()
    lines = [
        BEGIN, "",
        f"{len(tests)} tests of ONNX's backend node test suite (`onnx.backend.test`): those whose model uses "
        "only the default domain at opset <= 22 and only ops of onnx-mlir's CPU table. Each runs through "
        "bridge's importer and through onnxruntime and is compared with the test's expected outputs at the "
        "test's rtol/atol; inputs that bridge needs as constants (Slice starts, Resize scales, ...) are "
        "given as initializers. A gradient case (a floating-point input and first output, no piecewise "
        "constant or random op, a passing forward) turns its float inputs into weights and takes one "
        "mse + SGD step: float64 gradients against float64 finite differences of the source model in ONNX's "
        "reference evaluator (where a test's data sit at a kink, against torch's convention: the float64 "
        "autograd of a torch twin), the float32 graph against the float64 one, onnx-mlir's op table "
        "(`tests/helpers/oracle.py`). The float32 training graph is also compiled by onnx-mlir at its default "
        "flags and its step (loss, gradients, updates) compared with onnxruntime's on the same state "
        "(the onnx-mlir step column; its failures are in [onnx-mlir.md](onnx-mlir.md)). Generated by `docs/conformance.py` from "
        "`tests/onnx_node_expectations.json`, which `tests/test_onnx_node_suite.py` keeps exact.", "",
        *totals(tests), "", *per_op(tests), "",
        "Where onnxruntime disagrees with the expected outputs of the ONNX spec, bridge follows the spec:", "",
        *spec_disagreements(tests), "", END,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    from blocks import write_block

    write_block(DOC, BEGIN, END, render())
