"""Test-suite wiring: the IREE skip, the order and grouping pytest-xdist schedules, and
per-test seeds for module-level random generators.

The Makefile runs ``pytest -n 2 --dist loadgroup``: each test is its own work unit, handed to
whichever worker is free, in the order collected here (``slow`` tests first, then the groups
below, so that the longest work units start early instead of ending up serial at the tail),
except tests that share an expensive module-scoped fixture (``SHARED_FIXTURES``): those form one
``xdist_group`` and run on one worker, so the fixture is built once rather than once per worker
(as do tests marked with an ``xdist_group`` of their own: the ONNX node suite).
"""
import os
import re
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import importlib.util  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Module-scoped fixtures too expensive to build on both workers: one spawn of 2 ranks
# (test_distributed), one IREE compile per model family and batch mode (test_iree).
SHARED_FIXTURES = ("spawned", "compiled")


def pytest_configure(config):
    """One torch thread (and one onnxruntime thread, ``_one_onnxruntime_thread``) per pytest-xdist
    worker: the workers already fill the cores, and torch's default (a thread per core in each
    worker) oversubscribes them. Measured on the 2-core machine,
    test_conv.py's 252 lowering tests in one process: 7.6 s of CPU with one thread, 19.4 s with two."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        _one_onnxruntime_thread()


def _one_onnxruntime_thread() -> None:
    """Every onnxruntime session of this process runs one intra-op thread unless its options set a
    count: onnxruntime's default (a spinning thread per core) makes two workers' sessions fight
    for the two cores. Measured (efficientnet_b0's training step, one process, load ~4): session
    creation 5.7 -> 1.1 s of CPU, a step 0.72 -> 0.47 s of CPU. Options given are set in place
    (onnxruntime's SessionOptions cannot be copied); every caller makes its own per session."""
    import onnxruntime as ort

    init = ort.InferenceSession.__init__

    def one_thread(self, path_or_bytes, sess_options=None, *args, **kwargs):
        options = sess_options if sess_options is not None else ort.SessionOptions()
        if options.intra_op_num_threads == 0:
            options.intra_op_num_threads = 1
        init(self, path_or_bytes, options, *args, **kwargs)

    ort.InferenceSession.__init__ = one_thread


def _iree_installed() -> bool:
    return importlib.util.find_spec("iree") is not None and importlib.util.find_spec("iree.compiler") is not None


def _shared_fixture_group(item: pytest.Item) -> str | None:
    """The xdist group of a test using a ``SHARED_FIXTURES`` fixture: its module, the fixture and
    the fixture's parameter (one group per fixture instance)."""
    for name in SHARED_FIXTURES:
        if name in getattr(item, "fixturenames", ()):
            param = getattr(item, "callspec", None) and item.callspec.params.get(name)
            suffix = "" if param is None else "-" + re.sub(r"\W+", "_", str(param)).strip("_")
            return f"{item.module.__name__}.{name}{suffix}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Skip ``iree`` tests without IREE; group tests sharing an expensive fixture; slow tests first,
    then the groups (one work unit each: the largest of make test-fast)."""
    skip = None if _iree_installed() else pytest.mark.skip(reason="IREE is not installed: pip install 'bridge[iree]'")
    grouped = set()
    for item in items:
        if skip is not None and "iree" in item.keywords:
            item.add_marker(skip)
        group = _shared_fixture_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            grouped.add(item.nodeid)
    # stable: modules stay contiguous
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.nodeid not in grouped))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker sends the ids to the scheduler
def pytest_collection_finish(session):
    """Make ``--dist loadgroup`` group again: pytest-xdist (3.8) names a test's group by appending
    ``@group`` to ``item._nodeid``, which pytest 9.2 no longer reads (a node's id is ``item._id``),
    so every test became a work unit of its own: both workers spawned the 2 ranks of
    test_distributed.py and built every shared fixture (measured: two spawns in one run)."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in session.items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and not _grouped_id(item.nodeid):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def _grouped_id(nodeid: str) -> bool:
    """Whether ``nodeid`` ends in xdist's ``@group`` suffix (as xdist's scheduler reads it)."""
    return nodeid.rfind("@") > nodeid.rfind("]")


def seed_of(node: pytest.Item) -> int:
    """The seed of ``node``'s module-level generators: a function of its module and name only."""
    return zlib.crc32(f"{node.module.__name__}::{node.name}".encode())


@pytest.fixture(autouse=True)
def _seeded_module_generators(request, monkeypatch):
    """Every module-level numpy ``Generator`` (``rng = np.random.default_rng(...)``) is replaced, for
    each test, by one seeded from the test's id: what a test draws no longer depends on which
    tests ran before it in its worker (pytest-xdist changes that from run to run)."""
    module = getattr(request, "module", None)
    for name, value in list(vars(module).items()) if module is not None else ():
        if isinstance(value, np.random.Generator):
            monkeypatch.setattr(module, name, np.random.default_rng(seed_of(request.node)))


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
