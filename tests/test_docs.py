"""The docs read as guides: a short README whose example runs, no overlong lines outside the
generated blocks, no "session N" / "stop N" references or dates outside docs/notes/, and no
relative link to a file that does not exist."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
# docs/notes/ holds dated lab notes: not checked.
GUIDES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "lowerings").glob("*.md"))]
MAX_README_LINES = 90
MAX_LINE = 300
# A generated block (docs/*.py scripts render them, tests/generated_docs.py checks them).
BEGIN, END = re.compile(r"<!-- .+: begin -->"), re.compile(r"<!-- .+: end -->")
HISTORY = re.compile(r"\b(?:session|stop) \d+\b|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)
HISTORY_FILES = [*GUIDES, ROOT / "Makefile", *sorted((ROOT / "examples").glob("*.py")),
                 *sorted((ROOT / "bridge").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _hand_written_lines(path: Path):
    """(line number, line) of ``path`` outside its generated blocks."""
    generated = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if BEGIN.search(line):
            generated = True
        elif END.search(line):
            generated = False
        elif not generated:
            yield number, line


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines: keep it under {MAX_README_LINES}, move detail to docs/"


@pytest.mark.parametrize("doc", GUIDES, ids=_rel)
def test_no_overlong_lines(doc: Path):
    long = [f"{_rel(doc)}:{n} ({len(line)} characters)" for n, line in _hand_written_lines(doc) if len(line) > MAX_LINE]
    assert not long, f"lines over {MAX_LINE} characters (split them, or move detail to docs/notes/): {long}"


@pytest.mark.parametrize("path", HISTORY_FILES, ids=_rel)
def test_no_session_references_or_dates(path: Path):
    found = [f"{_rel(path)}:{n}: {m.group(0)!r}" for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in HISTORY.finditer(line)]
    assert not found, f"history belongs in docs/notes/ or commit messages: {found}"


@pytest.mark.parametrize("doc", GUIDES, ids=_rel)
def test_relative_links_exist(doc: Path):
    broken = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            if not (doc.parent / target.split("#")[0]).exists():
                broken.append(f"{_rel(doc)}:{n}: {target}")
    assert not broken, f"links to missing files: {broken}"


def test_readme_example_runs(tmp_path: Path):
    """README's Python example, as written, on the bundled example model."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "train.onnx").exists(), result.stdout
    loss = float(result.stdout.split()[1])
    assert loss < math.log(2), f"the example does not train: {result.stdout}"  # below guessing between its 2 labels
