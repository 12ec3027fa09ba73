"""The ONNX backend node tests (the subset of tests/onnx_node_suite.py) hold their recorded verdicts.

``tests/onnx_node_expectations.json`` records, per test, bridge's forward verdict, onnxruntime's
and the gradient verdict. Any change fails, a fix as much as a regression (like a strict xfail):
after a fix, rewrite the file with ``BRIDGE_UPDATE_EXPECTATIONS=1 pytest tests/test_onnx_node_suite.py``
(the tests then record instead of compare, ``-m slow`` included for the gradients) or with
``python tests/onnx_node_suite.py``, and regenerate docs/models.md with ``docs/conformance.py``.

Forward verdicts run in the default tier (~15 s); gradient verdicts are slow except for
``GRADIENT_SAMPLE``, one test per op family.
"""
from __future__ import annotations

import os

import pytest

import onnx_node_suite as suite
from generated_docs import assert_generated_block_current

UPDATE = os.environ.get("BRIDGE_UPDATE_EXPECTATIONS") == "1"
EXPECTED = suite.load_expectations()
NAMES = sorted(EXPECTED)

# One gradient case per op family, run in the default tier.
GRADIENT_SAMPLE = frozenset()

_recorded: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_recorded():
    """In update mode, merge what the tests recorded into the expectations file."""
    yield
    if UPDATE and _recorded:
        merged = suite.load_expectations()
        for name, entry in _recorded.items():
            merged.setdefault(name, {}).update(entry)
        suite.write_expectations(merged)


def _check(name: str, got: dict[str, object]) -> None:
    if UPDATE:
        _recorded.setdefault(name, {}).update(got)
        return
    want = {key: EXPECTED[name].get(key) for key in got}
    assert got == want, (f"{name}: verdicts changed {want} -> {got}; if this is a fix, update "
                         "tests/onnx_node_expectations.json (BRIDGE_UPDATE_EXPECTATIONS=1)")


def test_expectations_cover_the_subset():
    """The expectations file names exactly the selected tests (a new onnx version changes both)."""
    selected = set(suite.cases())
    if UPDATE:
        for name in selected - set(EXPECTED):
            _recorded[name] = suite.verdicts(name)
        return
    assert selected == set(EXPECTED), (
        f"missing: {sorted(selected - set(EXPECTED))[:10]}, stale: {sorted(set(EXPECTED) - selected)[:10]}")


@pytest.mark.parametrize("name", NAMES)
def test_forward(name):
    """bridge's importer and onnxruntime against the test's expected outputs."""
    _check(name, suite.forward_verdicts(name))


@pytest.mark.parametrize("name", [n if n in GRADIENT_SAMPLE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in NAMES])
def test_gradient(name):
    """One mse + SGD step against float64 finite differences (helpers/oracle.py)."""
    _check(name, {"grad": suite.grad_verdict(name)})


def test_gradient_sample_is_gradient_cases():
    """The default-tier sample holds only tests that reach a gradient verdict, one per op family."""
    families = [EXPECTED[n]["family"] for n in GRADIENT_SAMPLE]
    assert len(families) == len(set(families))
    assert all(not EXPECTED[n]["grad"].startswith("n/a") for n in GRADIENT_SAMPLE)


def test_conformance_doc_current():
    assert_generated_block_current("conformance.py", "models.md", "render")
