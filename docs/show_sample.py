"""Render docs/ir.md's ``bridge show`` sample from a real conversion, so it cannot go stale.

The model is examples/traverse_ir.py's CNN converted with ``--loss ce --optim adam``; the input
and output lists are shortened to their first and last lines. Run
``.venv/bin/python docs/show_sample.py`` to rewrite the block in docs/ir.md (tests/test_show.py
checks that it is current).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

BEGIN, END = "<!-- bridge show sample: begin -->", "<!-- bridge show sample: end -->"
KEEP = 3  # lines kept at each end of the inputs and outputs lists


def _shorten(text: str) -> list[str]:
    """Keep the first and last ``KEEP`` lines of the inputs and outputs lists."""
    out: list[str] = []
    listing: list[str] | None = None  # lines of the inputs/outputs list being read
    for line in text.splitlines() + [""]:
        if listing is not None and line.startswith("  "):
            listing.append(line)
            continue
        if listing is not None:
            out += listing if len(listing) <= 2 * KEEP + 1 else listing[:KEEP] + ["  ..."] + listing[-KEEP:]
            listing = None
        out.append(line)
        if line.startswith(("inputs:", "outputs:")):
            listing = []
    return out[:-1]


def render() -> str:
    from traverse_ir import export_cnn

    import bridge
    from bridge.tools.show import summary

    with tempfile.TemporaryDirectory() as tmp:
        source = export_cnn(Path(tmp) / "cnn.onnx")
        bridge.to_training_onnx(source, loss="ce", optim="adam", output_path=Path(tmp) / "cnn_train.onnx")
        text = summary(bridge.ir.load(Path(tmp) / "cnn_train.onnx"))
    return "\n".join([BEGIN, "```", *_shorten(text), "```", END])


if __name__ == "__main__":
    from blocks import write_block

    write_block(ROOT / "docs" / "ir.md", BEGIN, END, render())
