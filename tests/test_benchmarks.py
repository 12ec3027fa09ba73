"""The step-time benchmark (benchmarks/run.py) measures what it says, and rewrites only its own
section of benchmarks/RESULTS.md."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import run as bench  # noqa: E402


@pytest.mark.slow
def test_mlp_side_by_side(capsys):
    assert bench.main(["--models", "mlp", "--backends", "bridge-ort", "torch", "--rounds", "15",
                       "--max-load", "1000", "--no-write"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| mlp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 4 and float(cells[3]) > 0  # bridge-ort, torch, and the ratio
    assert "| mlp | 0.3 |" in out  # 64*256 + 256*256 + 256*10 weights (+ biases): 0.3 MB


def test_refuses_a_busy_machine(capsys, monkeypatch):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert bench.main(["--models", "mlp", "--max-load", "1.0"]) == 2
    assert "busy" in capsys.readouterr().out


def test_rounds_below_15_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "5"])


def test_rewrites_only_its_own_section(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Data-parallel\n\nkept\n")
    monkeypatch.setattr(bench, "RESULTS", results)
    bench.write_results(f"{bench.BEGIN}\nfirst\n{bench.END}\n")
    bench.write_results(f"{bench.BEGIN}\nsecond\n{bench.END}\n")
    text = results.read_text()
    assert "kept" in text and "second" in text and "first" not in text and text.count(bench.BEGIN) == 1
