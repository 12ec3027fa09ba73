"""Write a generated block into its doc: the text from a script's BEGIN marker to its END marker
(``tests/generated_docs.py`` checks that the doc holds what the script renders)."""
from __future__ import annotations

from pathlib import Path


def write_block(doc: Path, begin: str, end: str, block: str) -> None:
    """Replace ``doc``'s text from ``begin`` through ``end`` by ``block`` (which starts and ends with them)."""
    text = doc.read_text()
    start, stop = text.index(begin), text.index(end) + len(end)
    doc.write_text(text[:start] + block + text[stop:])
    print(f"wrote {doc}")
