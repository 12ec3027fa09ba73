"""The comparison notebooks run top to bottom (their cells assert the comparison)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert code, f"{path} has no code"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for index, source in enumerate(code):
        exec(compile(source, f"{path.name}[cell {index}]", "exec"), namespace)  # noqa: S102


def test_notebooks_are_found():
    """The glob is anchored on this file: run from any directory, the notebooks are collected."""
    assert NOTEBOOKS, "no notebook found under notebooks/"
