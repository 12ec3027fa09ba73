"""Checkpoints of a training session: one ``.npz`` written atomically (temp file + os.replace).

It holds every state tensor (weights, buffers, optimizer state, ``step``, ``lr``) under
``state/<name>`` and one JSON document under ``meta``: the training graph's hash (a
checkpoint is refused by a session of another graph), the noise generator's state (so a
resumed run draws the same Dropout masks) and the caller's ``extra`` (the Trainer's epoch,
schedule position, history).
"""
from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_writer
from ..errors import BridgeError

FORMAT = "bridge.training.checkpoint/1"
_STATE = "state/"


class CheckpointError(BridgeError):
    """A checkpoint is missing, damaged, or was written for another training graph."""


def write_checkpoint(path: str | os.PathLike, state: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
    """Write ``state`` and ``meta`` to ``path``; a failed write leaves no partial file."""
    path = Path(path)
    arrays = {_STATE + name: np.asarray(value) for name, value in state.items()}
    arrays["meta"] = np.asarray(json.dumps({"format": FORMAT, **meta}))
    with atomic_writer() as writer, open(writer.path(path, "checkpoint path"), "xb") as file:
        np.savez(file, **arrays)
    return path


def read_checkpoint(path: str | os.PathLike, graph_hash: str, names: set[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The state and meta of a checkpoint for the graph ``graph_hash`` whose state holds ``names``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            state = {key[len(_STATE):]: data[key] for key in data.files if key.startswith(_STATE)}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} is not a bridge checkpoint: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a bridge checkpoint (format {meta.get('format')!r})")
    if meta["graph_hash"] != graph_hash:
        raise CheckpointError(
            f"{path} was written for another training graph (sha256 {meta['graph_hash'][:12]}..., this session's "
            f"is {graph_hash[:12]}...): load it into a session of the graph that wrote it"
        )
    if set(state) != names:
        raise CheckpointError(f"{path} holds state {sorted(set(state) ^ names)} that this session does not (or lacks it)")
    return state, meta
