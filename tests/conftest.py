import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import importlib.util  # noqa: E402

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``iree`` skip when IREE (the ``bridge[iree]`` install extra) is missing."""
    if importlib.util.find_spec("iree") is not None and importlib.util.find_spec("iree.compiler") is not None:
        return
    skip = pytest.mark.skip(reason="IREE is not installed: pip install 'bridge[iree]'")
    for item in items:
        if "iree" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The lines tests record with ``record_property("summary", line)`` (the fuzzers' example counts), in
    the terminal summary: under pytest-xdist (``make test``) what a test prints is not shown."""
    lines = [value for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "call"
             for name, value in getattr(report, "user_properties", ()) if name == "summary"]
    if lines:
        terminalreporter.section("summaries")
        for line in lines:
            terminalreporter.write_line(line)
