"""Checkpoints of a training session: one ``.npz`` written atomically (temp file + os.replace).

It holds every state tensor (weights, buffers, optimizer state, ``step``, ``lr``) under
``state/<name>`` and one JSON document under ``meta``: the training graph's hash (a
checkpoint is refused by a session of another graph), the noise generator's state (so a
resumed run draws the same Dropout masks) and the caller's ``extra`` (the Trainer's epoch,
schedule position, history). Federated deltas (bridge/training/delta.py) are written and read
in the same layout (``write_archive``, ``read_archive``).
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


def write_archive(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], prefix: str, header: Mapping[str, Any],
                  what: str) -> Path:
    """Write ``arrays``, each under ``prefix`` + its name, and the JSON ``header`` under ``meta`` to ``path``
    atomically: a failed write leaves no partial file. ``what`` names the path in errors (``"checkpoint path"``)."""
    path = Path(path)
    saved = {prefix + name: np.asarray(value) for name, value in arrays.items()}
    saved["meta"] = np.asarray(json.dumps(header))
    with atomic_writer() as writer, open(writer.path(path, what), "xb") as file:
        np.savez(file, **saved)
    return path


def read_archive(path: str | os.PathLike, prefix: str, file_format: str, error: type[BridgeError], kind: str,
                 hint: str = "") -> tuple[dict[str, np.ndarray], dict]:
    """The arrays (names without ``prefix``) and header ``write_archive`` wrote to ``path``; ``error`` naming the
    ``kind`` of file and the path where it is missing, damaged or of another format than ``file_format``
    (``hint``: how to write one)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"no {kind} at {path}")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(str(data["meta"]))
            arrays = {key.removeprefix(prefix): data[key] for key in data.files if key.startswith(prefix)}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise error(f"{path} is not a bridge {kind} ({exc}){hint}") from exc
    if header.get("format") != file_format:
        raise error(f"{path} is not a bridge {kind} (format {header.get('format')!r})")
    return arrays, header


def write_checkpoint(path: str | os.PathLike, state: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
    """Write ``state`` and ``meta`` to ``path``; a failed write leaves no partial file."""
    return write_archive(path, state, _STATE, {"format": FORMAT, **meta}, "checkpoint path")


def read_checkpoint(path: str | os.PathLike, graph_hash: str, names: set[str]) -> tuple[dict[str, np.ndarray], dict]:
    """The state and meta of a checkpoint for the graph ``graph_hash`` whose state holds ``names``."""
    state, meta = read_archive(path, _STATE, FORMAT, CheckpointError, "checkpoint")
    if meta["graph_hash"] != graph_hash:
        raise CheckpointError(
            f"{path} was written for another training graph (sha256 {meta['graph_hash'][:12]}..., this session's "
            f"is {graph_hash[:12]}...): load it into a session of the graph that wrote it"
        )
    if set(state) != names:
        raise CheckpointError(f"{path} holds state {sorted(set(state) ^ names)} that this session does not (or lacks it)")
    return state, meta
