"""The notebooks in notebooks/: each source (``<name>.py``, jupytext percent format) has its rendered
``<name>.ipynb`` with the same code and saved outputs, plots included, and re-executing the source
gives those outputs (``make notebooks`` re-renders them). The notebooks' own cells assert the
comparisons they show."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
pytest.importorskip("jupytext")
pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")


def _render_module():
    spec = importlib.util.spec_from_file_location("notebooks_render", NOTEBOOKS / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _render_module()
SOURCES = render.sources()


def _cells(notebook) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def test_at_least_three_notebooks_each_rendered_from_its_source_with_outputs_and_a_plot():
    assert len(SOURCES) >= 3, [s.name for s in SOURCES]
    for source in SOURCES:
        saved = nbformat.read(render.rendered_path(source), as_version=4)
        expected = render.jupytext.read(source)
        assert _cells(saved) == _cells(expected), f"{source.name} changed since it was rendered: make notebooks"
        assert all(cell.execution_count for cell in saved.cells if cell.cell_type == "code"), (
            f"{source.name} was saved without running every cell: make notebooks")
        outputs = [output for cell in saved.cells if cell.cell_type == "code" for output in cell.outputs]
        assert not [o for o in outputs if o.output_type == "error"], f"{source.name} was saved with an error"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{source.name} saves no plot"


def test_the_comparison_masks_noise_and_timing_only():
    cell = nbformat.v4.new_code_cell("print()")
    cell.outputs = [nbformat.v4.new_output("stream", text="loss 1.23456 diff 3.1e-07 step 30\ntiming: 12.5 ms\n")]
    other = nbformat.v4.new_code_cell("print()")
    other.outputs = [nbformat.v4.new_output("stream", text="loss 1.23456 diff 9.9e-08 step 30\ntiming: 80 ms\n")]
    notebook, changed = nbformat.v4.new_notebook(cells=[cell]), nbformat.v4.new_notebook(cells=[other])
    assert render.comparable(notebook) == render.comparable(changed) == [["loss 1.23456 diff <noise> step 30"]]
    other.outputs[0].text = "loss 1.23457 diff 9.9e-08 step 30\n"
    assert render.comparable(notebook) != render.comparable(changed)


def _missing_tools(source: Path) -> list[str]:
    missing = []
    for tool in render.requires(source):
        if tool == "iree" and importlib.util.find_spec("iree") is None:
            missing.append(tool)
        if tool == "onnx-mlir":
            from bridge.tools.target_check import onnx_mlir_missing

            if onnx_mlir_missing() is not None:
                missing.append(tool)
    return missing


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_saved_outputs_are_current(source):
    """Re-executed, the source prints what the saved notebook shows (timing lines and float32-noise
    numbers aside) and draws the same plots."""
    missing = _missing_tools(source)
    if missing:
        pytest.skip(f"{source.name}'s saved outputs used {missing}, not installed here")
    fresh = render.execute(source)
    saved = nbformat.read(render.rendered_path(source), as_version=4)
    assert render.comparable(fresh) == render.comparable(saved), f"{source.name}: saved outputs are stale: make notebooks"
