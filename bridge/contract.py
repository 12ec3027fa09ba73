"""The training-graph contract (stub on the ``imports`` branch: the names the readers need).

The ``contract`` branch writes the whole module (roles, prefixes, metadata keys, ``StepSignature``);
these definitions are the same. This module imports only the standard library: reading a saved
training graph never needs torch.
"""
from __future__ import annotations

PHASES = ("forward", "loss", "backward", "optimizer")

ROLE = "bridge.role"  # on graph inputs, outputs and value_info
PHASE, LAYER, KIND = "bridge.phase", "bridge.layer", "bridge.kind"  # on every node


def props(entries) -> dict[str, str]:
    """``metadata_props`` (of a model, node or value) as a dict."""
    return {entry.key: entry.value for entry in entries}
