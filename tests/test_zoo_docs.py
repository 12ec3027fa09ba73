"""docs/models.md lists exactly the ops the converter registry supports."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def test_models_doc_op_table_is_the_registry():
    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("supported_ops", root / "docs" / "supported_ops.py")
    supported_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(supported_ops)
    doc = (root / "docs" / "models.md").read_text()
    start, end = doc.index(supported_ops.BEGIN), doc.index(supported_ops.END) + len(supported_ops.END)
    assert doc[start:end] == supported_ops.table()
