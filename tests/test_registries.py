"""The three registries (``@converter``, ``@lowers``, ``@emits``) behave alike: one function per
op, typed signatures, only ``LoweringError`` from lowerings and emitters, generated tables current."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from generated_docs import assert_generated_block_current

from bridge.pipeline.export.builder import EMITTERS, emits, import_all_emitters
from bridge.pipeline.importer.registry import CONVERTERS, converter, import_all_converters
from bridge.pipeline.lowering import LOWERINGS, import_all_lowerings, lowers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def registries():
    import_all_converters()
    import_all_lowerings()
    import_all_emitters()


@pytest.mark.parametrize("table, decorator, key", [
    (CONVERTERS, converter, "Gemm"),
    (LOWERINGS, lowers, torch.ops.aten.convolution_backward.default),
    (EMITTERS, emits, torch.ops.aten.mm.default),
])
def test_second_registration_raises_and_keeps_the_first(table, decorator, key):
    first = table[key]

    def intruder(*args):
        return None

    with pytest.raises(RuntimeError, match=r"two \w+ for .* and .*intruder"):
        decorator(key)(intruder)
    assert table[key] is first


def _parameters(fn) -> list[str]:
    return list(inspect.signature(getattr(fn, "func", fn)).parameters)


def test_converters_and_emitters_fit_their_protocols():
    """``ConverterFn(ctx, *inputs)``, ``EmitterFn(b, node, *args)``: checked on every registered function."""
    bad = [op for op, c in CONVERTERS.items() if _parameters(c.fn)[:1] != ["ctx"]]
    assert bad == []
    bad = [str(target) for target, fn in EMITTERS.items() if _parameters(fn)[:2] != ["b", "node"]]
    assert bad == []


def _raised_names(path: Path) -> set[str]:
    """The exception names of every ``raise X(...)`` / ``raise X`` in a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            names.add(ast.unparse(exc))
    return names


@pytest.mark.parametrize("package", ["bridge/lowering", "bridge/pipeline/export/ops"])
def test_lowerings_and_emitters_raise_only_lowering_error(package):
    """Anything else (``NotImplementedError``, ``KeyError``) would escape the CLI's error report."""
    raised = {path.name: _raised_names(path) - {"LoweringError"} for path in (ROOT / package).glob("*.py")}
    assert {name: found for name, found in raised.items() if found} == {}


def test_registry_tables_are_current():
    assert_generated_block_current("registries.py", "registries.md", "table")


def _top_level_names(table: dict, function=lambda entry: entry) -> set[str]:
    """Names of the registered module-level functions (not those a factory builds)."""
    functions = (getattr(function(e), "func", function(e)) for e in table.values())
    return {fn.__name__ for fn in functions if "<locals>" not in fn.__qualname__}


def test_registered_names_never_clash_across_stages():
    """A converter, a lowering and an emitter of the same op are told apart by their names
    (``convert_``/``lower_``/``emit_`` prefixes where they would clash), not by module aliases."""
    converters = _top_level_names(CONVERTERS, lambda c: c.fn)
    lowerings, emitters = _top_level_names(LOWERINGS), _top_level_names(EMITTERS)
    assert {"convert_reshape", "lower_convolution", "emit_reshape"} <= converters | lowerings | emitters
    assert converters & lowerings == set()
    assert converters & emitters == set()
    assert lowerings & emitters == set()
