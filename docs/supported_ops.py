"""Render the supported-ONNX-ops table of docs/models.md from the converter registry.

One row per registered op type: the versions of the op that exist in opsets 11..22 (each
converter handles all of them), the inputs that must be known before the model runs, and
the module that converts it. Run: ``.venv/bin/python docs/supported_ops.py`` rewrites
the block between the markers (tests/test_zoo_docs.py checks that the doc is current).
"""
from __future__ import annotations

from pathlib import Path

import onnx.defs

from bridge.pipeline.importer.registry import CONVERTERS, import_all_converters
from bridge.pipeline.load import KNOWN_OPSET

BEGIN, END = "<!-- supported ops: begin -->", "<!-- supported ops: end -->"
FIRST_OPSET = 11


def _versions(key: str) -> str:
    """Versions of the op ``key`` names (``OpType``, or ``<domain>::<OpType>`` in another domain, whose
    own opset versions these are) that a model at default opset 11..MAX may use."""
    domain, _, op_type = key.rpartition("::")
    since = sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                    if s.name == op_type and s.domain == domain and (domain or s.since_version <= KNOWN_OPSET)})
    if not since:
        return "-"
    in_range = [v for v in since if v >= FIRST_OPSET]
    older = [v for v in since if v < FIRST_OPSET]
    return ", ".join(str(v) for v in ([older[-1]] if older else []) + in_range)


def table() -> str:
    import_all_converters()
    lines = [BEGIN, "", "| ONNX op | op versions (opsets 11-22) | static inputs | converter |", "| --- | --- | --- | --- |"]
    for op_type in sorted(CONVERTERS):
        conv = CONVERTERS[op_type]
        static = ", ".join(str(i) for i in conv.static) or "-"
        module = conv.fn.__module__.rsplit(".", 1)[-1]
        lines.append(f"| {op_type} | {_versions(op_type)} | {static} | `ops/{module}.py` |")
    lines += ["", f"{len(CONVERTERS)} op types.", "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    from blocks import write_block

    write_block(Path(__file__).with_name("models.md"), BEGIN, END, table())
