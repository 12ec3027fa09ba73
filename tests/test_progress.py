"""Progress output of long conversions (bridge.pipeline.progress, printed by ``bridge convert``)."""
from __future__ import annotations

import io
import threading

from bridge.pipeline import progress


def test_a_long_conversion_reports_its_phase_and_the_elapsed_time():
    stream, reported = io.StringIO(), threading.Event()
    with progress.phase("tracing the training step"), progress.report(stream, after=0.01, every=0.01):
        while "tracing" not in stream.getvalue():
            reported.wait(0.01)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("bridge: tracing the training step (") and lines[0].endswith(" s)")
    assert lines[-1].startswith("bridge: converted in ")


def test_a_quick_conversion_prints_nothing():
    stream = io.StringIO()
    with progress.report(stream, after=60):
        with progress.phase("loading the model"):
            pass
    assert stream.getvalue() == ""


def test_a_phase_ends_with_its_block():
    with progress.phase("outer"):
        with progress.phase("inner"):
            assert progress._current["phase"] == "inner"
        assert progress._current["phase"] == "outer"
    assert progress._current["phase"] == ""
