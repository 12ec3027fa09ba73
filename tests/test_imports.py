"""The package's import structure: no cycle, readers without torch, a fast ``import bridge``.

Budgets (docs/ARCHITECTURE.md, "Import structure"): ``import bridge`` < 1.5 s and ``bridge --help``
< 2 s on the development machine; the tests allow 3x that (best of 3, each in a fresh
interpreter), since CI machines and a loaded machine are slower.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bridge"

# modules that read or run a saved training graph: onnx + onnxruntime (+ numpy), never torch
TORCH_FREE = ("bridge", "bridge.contract", "bridge.onnx_file", "bridge.pipeline.load", "bridge.ir", "bridge.tools.show", "bridge.tools.target_check",
              "bridge.training.runtime", "bridge.tools.compile", "bridge.training.runtime_iree", "bridge.geometry", "bridge.dtypes",
              "bridge.attributes", "bridge.cli")
IMPORT_BRIDGE_S, HELP_S, SLACK = 1.5, 2.0, 3.0


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(statements: list[ast.stmt]):
    """Import statements run when the module is imported: not in functions, classes or
    ``if TYPE_CHECKING:`` blocks."""
    for statement in statements:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            yield statement
        elif isinstance(statement, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(statement.test):
                yield from _top_level_imports(statement.body + statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _top_level_imports(statement.body + statement.orelse + statement.finalbody)


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """``{module: the package modules it imports at import time}`` over ``bridge/**.py``."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for statement in _top_level_imports(ast.parse(path.read_text()).body):
            if isinstance(statement, ast.Import):
                targets.update(a.name for a in statement.names if a.name in paths)
                continue
            base = ".".join(package[:len(package) - statement.level + 1] + [statement.module or ""]).strip(".") \
                if statement.level else statement.module
            for alias in statement.names:
                name = f"{base}.{alias.name}"
                targets.add(name if name in paths else base)
        graph[module] = {t for t in targets if t in paths and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path of modules, or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"bridge.api", "bridge.pipeline.importer.registry", "bridge.pipeline.export.ops.nn"} <= set(graph)
    assert "bridge.pipeline.lowering" in graph["bridge.pipeline.lowering.conv"]  # the walker sees relative imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module, forbidden", [
    ("bridge.pipeline.load", "bridge.pipeline.importer"),  # stage 1 knows nothing of the importer
    ("bridge.ir", "bridge.pipeline.annotate"),  # readers do not import the writer
    ("bridge.tools.show", "bridge.pipeline.annotate"),
    ("bridge.tools.target_check", "bridge.ir"),
    ("bridge.training.runtime_iree", "bridge.tools.compile"),
    ("bridge.pipeline.importer", "bridge.pipeline.lowering"),  # stages share geometry through bridge.geometry only
    ("bridge.pipeline.export", "bridge.pipeline.lowering"),
    ("bridge.pipeline.primitives", "bridge.pipeline.importer"),  # bridge's own ops: shared by the writer's stages, importing none
    ("bridge.pipeline.primitives", "bridge.pipeline.export"),
])
def test_dependencies_point_one_way(module, forbidden):
    graph = import_graph()
    importers = [m for m in graph if m == module or m.startswith(module + ".")]
    assert importers
    wrong = {m: sorted(t for t in graph[m] if t == forbidden or t.startswith(forbidden + "."))
             for m in importers}
    assert not any(wrong.values()), wrong


LAYERS = ("pipeline", "training", "tools")
ENTRY_POINTS = ("bridge", "bridge.api", "bridge.cli", "bridge.__main__")


def _layer(module: str) -> str:
    parts = module.split(".")
    if module in ENTRY_POINTS:
        return module
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else "shared"


def test_layers_point_one_way():
    """The layout's direction (docs/ARCHITECTURE.md): the shared modules (contract, errors, onnx_file,
    ir, ...) import no layer; the pipeline and the training runtime import only shared modules; the
    tools may import everything; only the entry points (api, cli) join the layers."""
    allowed = {"shared": {"shared"}, "pipeline": {"pipeline", "shared"}, "training": {"training", "shared"},
               "tools": {"tools", "pipeline", "training", "shared", "bridge.api"}}  # verify converts
    graph = import_graph()
    wrong = {m: sorted(t for t in targets if not {_layer(t), t} & allowed[_layer(m)])
             for m, targets in graph.items() if m not in ENTRY_POINTS}
    wrong = {m: t for m, t in wrong.items() if t}
    assert not wrong, wrong


def test_graph_readers_import_no_torch():
    """A user who only runs or reads a saved training graph needs onnx + onnxruntime, not torch."""
    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module(name)\n"
            "    heavy = [m for m in ('torch', 'sympy') if m in sys.modules]\n"
            "    assert not heavy, f'import {name} imported {heavy}'\n"
            "import bridge\n"
            "assert bridge.TrainingSession.__module__ == 'bridge.training.runtime' and 'torch' not in sys.modules\n"
            "assert callable(bridge.compile) and callable(bridge.check)  # not the submodules of those names\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_public_names_resolve_lazily():
    """Every name in ``bridge.__all__`` resolves, importing its module on first use."""
    import bridge

    assert [n for n in bridge.__all__ if getattr(bridge, n, None) is None] == []
    assert bridge.verify is sys.modules["bridge.tools.verify"].verify
    assert bridge.compile is sys.modules["bridge.tools.compile"].compile
    assert bridge.check is sys.modules["bridge.tools.target_check"].check
    assert bridge.ir is sys.modules["bridge.ir"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        bridge.nope  # noqa: B018


def _best_of_3(command: list[str]) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=120)
        times.append(time.perf_counter() - start)
    return min(times)


def test_import_time_budget():
    seconds = _best_of_3([sys.executable, "-c", "import bridge"])
    assert seconds < SLACK * IMPORT_BRIDGE_S, f"import bridge took {seconds:.2f} s"


def test_help_time_budget():
    seconds = _best_of_3([sys.executable, "-m", "bridge", "--help"])
    assert seconds < SLACK * HELP_S, f"bridge --help took {seconds:.2f} s"
