"""Render the wild-tier table of docs/models.md from tests/wild/manifest.json.

One row per file: its source (a wheel, a package's test data, or an exporter run by
tests/wild/build.py), the exporter, where it runs (CI or the exhaustive tier) and what the tier
expects of it (trains against the oracle, or refused and why), and whether its weights were drawn
anew (tests/wild/weights.py). Run:
``.venv/bin/python docs/wild_tier.py`` rewrites the block between the markers
(tests/test_wild.py checks that the doc is current).
"""
from __future__ import annotations

import json
from pathlib import Path

BEGIN, END = "<!-- wild tier: begin -->", "<!-- wild tier: end -->"
MANIFEST = Path(__file__).parent.parent / "tests" / "wild" / "manifest.json"
RESULTS = {"trains": "trains, matches the oracle", "refused": "refused: {why}",
           "gap": "refused (not a real limit, to lift): {why}",
           "needs output pruning": "refused until unused outputs are pruned: {why}",
           "unchecked": "expected to train; not yet run against the oracle",
           "open": "trains; a mismatch to explain: {why}"}
FRESH_WEIGHTS = "the file's are one value repeated, which no finite difference can judge"
COUNTED = {"trains": "train and match the oracle", "refused": "refused for a real limit",
           "gap": "refused for a limit to lift", "needs output pruning": "wait for output pruning",
           "open": "with a mismatch to explain", "unchecked": "not yet run"}


def table() -> str:
    manifest = json.loads(MANIFEST.read_text())
    lines = [BEGIN, "", "| file | source | exporter | tier | result |", "| --- | --- | --- | --- | --- |"]
    for name, entry in manifest.items():
        expected = entry["expected"]
        result = RESULTS[expected["result"]].format(why=expected.get("why", ""))
        if "weights" in entry:
            result += f" (with fresh weights, seed {entry['weights']['seed']}: {FRESH_WEIGHTS})"
        tier = "CI" if entry["location"] == "files" else "exhaustive"
        lines.append(f"| {name} | {entry['source']} | {entry['exporter']} | {tier} | {result} |")
    counts = {}
    for entry in manifest.values():
        counts[entry["expected"]["result"]] = counts.get(entry["expected"]["result"], 0) + 1
    exporters = {entry["exporter"].split()[0] for entry in manifest.values()}
    summary = ", ".join(f"{counts[result]} {label}" for result, label in COUNTED.items() if result in counts)
    lines += ["", f"{len(manifest)} files from {len(exporters)} exporters: {summary}.", "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    from blocks import write_block

    write_block(Path(__file__).with_name("models.md"), BEGIN, END, table())
