"""Render the tables of bridge's lowerings and emitters (docs/registries.md) from their registries.

One row per registered ATen op: the function that lowers it (``@lowers``, ``bridge/pipeline/lowering/``)
or emits it as ONNX (``@emits``, ``bridge/pipeline/export/ops/``). The converter table (``@converter``)
is in docs/models.md (docs/supported_ops.py). Run ``.venv/bin/python docs/registries.py``
to rewrite the block of docs/registries.md (tests/test_registries.py checks that it is current).
"""
from __future__ import annotations

from pathlib import Path

from bridge.pipeline.export.builder import EMITTERS, import_all_emitters
from bridge.pipeline.lowering import LOWERINGS, import_all_lowerings

BEGIN, END = "<!-- registries: begin -->", "<!-- registries: end -->"
DOC = Path(__file__).with_name("registries.md")


def _rows(table: dict, package: str) -> list[str]:
    rows = []
    for target, fn in table.items():
        fn = getattr(fn, "func", fn)  # a functools.partial: the function it wraps
        path = fn.__module__.removeprefix(package + ".").replace(".", "/")
        name, _, made = fn.__qualname__.partition(".<locals>")  # made: a function built by a factory
        rows.append(f"| `{target}` | `{path}.py` | `{name}{'(...)' if made else ''}` |")
    return sorted(rows)


def table() -> str:
    import_all_lowerings()
    import_all_emitters()
    return "\n".join([
        BEGIN, "",
        "### Lowerings (`@lowers`, `bridge/pipeline/lowering/`)", "",
        "| ATen op | module | function |", "| --- | --- | --- |",
        *_rows(LOWERINGS, "bridge.pipeline.lowering"), "",
        f"{len(LOWERINGS)} ATen ops lowered.", "",
        "### Emitters (`@emits`, `bridge/pipeline/export/ops/`)", "",
        "| ATen op | module | function |", "| --- | --- | --- |",
        *_rows(EMITTERS, "bridge.pipeline.export.ops"), "",
        f"{len(EMITTERS)} ATen ops (and size callables) emitted.", "",
        END,
    ])


if __name__ == "__main__":
    from blocks import write_block

    write_block(DOC, BEGIN, END, table())
