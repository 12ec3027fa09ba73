"""Docs with generated blocks: a script in docs/ renders a block between its BEGIN/END markers."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).parent.parent


def assert_generated_block_current(script: str, doc: str, render: str,
                                   normalize: Callable[[str], str] = lambda text: text) -> None:
    """``docs/<doc>`` holds exactly what ``docs/<script>``'s ``render()`` produces (both seen through ``normalize``)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / "docs" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = (ROOT / "docs" / doc).read_text()
    start, end = text.index(module.BEGIN), text.index(module.END) + len(module.END)
    assert normalize(text[start:end]) == normalize(getattr(module, render)()), f"docs/{doc} is stale: run docs/{script}"
