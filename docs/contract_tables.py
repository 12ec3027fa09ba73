"""Render docs/ir.md's tables of roles and keys from ``bridge.contract``, so they cannot go stale.

Run ``.venv/bin/python docs/contract_tables.py`` to rewrite the block in docs/ir.md
(tests/test_contract.py checks that it is current).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- contract tables: begin -->", "<!-- contract tables: end -->"


def render() -> str:
    from bridge import contract

    lines = [BEGIN, "", "| role (`bridge.role`) | values | what |", "| --- | --- | --- |"]
    lines += [f"| `{role}` | {names} | {what} |" for role, (names, what) in contract.ROLE_DOCS.items()]
    lines += ["", "| key | on | value |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {where} | {value} |" for key, (where, value) in contract.KEY_DOCS.items()]
    return "\n".join(lines + ["", END])


if __name__ == "__main__":
    from blocks import write_block

    write_block(ROOT / "docs" / "ir.md", BEGIN, END, render())
