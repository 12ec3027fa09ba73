"""Render the notebooks: each ``notebooks/<name>.py`` (jupytext percent format, the source kept in
git) is executed top to bottom in a fresh kernel and written as ``notebooks/<name>.ipynb`` with its
outputs, plots included.

    .venv/bin/python notebooks/render.py [name ...]      (make notebooks)

Outputs are deterministic (seeded, one thread), so ``tests/test_notebooks.py`` re-executes each
source and compares its outputs with the saved ones (``comparable``): lines starting with
``timing:`` and numbers below ``NOISE`` in magnitude (float32 round-off, which varies with the
CPU) are left out of that comparison; pictures are compared by their presence.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NOISE = 1e-4  # printed numbers below this are float32 noise: shown, not compared
TIMING_PREFIX = "timing:"
# the external tools a notebook's saved outputs used (metadata "bridge_requires"): without one, its
# outputs differ (a "not found" line instead of the comparison), so the staleness check is skipped
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def sources() -> list[Path]:
    """The notebook sources: every ``.py`` here but this script."""
    return sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name)


def execute(source: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """``source`` as a notebook, executed in a fresh python3 kernel whose working directory is a
    temporary folder, importing this checkout's ``bridge`` with one thread."""
    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for index, cell in enumerate(notebook.cells):
        cell.id = f"{source.stem}-{index}"  # stable ids: a re-render changes only what changed
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        with tempfile.TemporaryDirectory() as work:
            # IPC: the kernel's sockets are files in the temporary folder, not TCP ports
            kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(work) / "kernel"))
            try:
                NotebookClient(notebook, km=kernel, timeout=timeout, record_timing=False,
                               resources={"metadata": {"path": work}}).execute()
            finally:
                if kernel.has_kernel:
                    kernel.shutdown_kernel(now=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return notebook


def rendered_path(source: Path) -> Path:
    return source.with_suffix(".ipynb")


def comparable(notebook: nbformat.NotebookNode) -> list[list[str]]:
    """Per code cell, its outputs as text lines with timing lines dropped, noise-sized numbers
    masked, and each picture as ``<image/png>``."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        lines: list[str] = []
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                text = output.text
            elif output.output_type == "error":
                text = f"{output.ename}: {output.evalue}"
            else:
                data = output.get("data", {})
                text = "<image/png>" if "image/png" in data else data.get("text/plain", "")
            lines += [_mask(line) for line in text.splitlines() if not line.startswith(TIMING_PREFIX)]
        cells.append(lines)
    return cells


def _mask(line: str) -> str:
    def noise(match: re.Match) -> str:
        return "<noise>" if abs(float(match.group())) < NOISE else match.group()

    return NUMBER.sub(noise, line)


def requires(source: Path) -> list[str]:
    """The external tools (``onnx-mlir``, ``iree``) the notebook's outputs depend on."""
    return list(jupytext.read(source).metadata.get("bridge_requires", []))


def main(names: list[str]) -> None:
    chosen = [s for s in sources() if not names or s.stem in names]
    for source in chosen:
        print(f"rendering {source.name}", flush=True)
        notebook = execute(source)
        nbformat.write(notebook, rendered_path(source))
    unknown = set(names) - {s.stem for s in chosen}
    if unknown:
        raise SystemExit(f"no notebook source named {sorted(unknown)} in {HERE}: {json.dumps([s.stem for s in sources()])}")


if __name__ == "__main__":
    main(sys.argv[1:])
