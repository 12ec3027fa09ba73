"""Federated-ready state: the trained weights as a delta against the weights a round started from.

A client trains from the global weights and writes ``weights - round start`` (``write_delta``, one ``.npz``
of float64 differences and a small JSON header); a server averages the clients' deltas (``average_deltas``,
weighted by their sample counts: FedAvg) and each client adds the average to its round start
(``Trainer.load_delta``). Only trained weights travel: for a LoRA conversion, the adapters. Optimizer state and
buffers stay with each client.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from ..contract import ROLE, Role, props
from ..errors import BridgeError, InvalidOptionError
from .checkpoint import read_archive, write_archive

FORMAT = "bridge.training.delta/1"
_DELTA = "delta/"


class DeltaError(BridgeError):
    """A delta file that is missing, damaged, or holds other weights than this training graph trains."""


def trained_weights(model: onnx.ModelProto) -> list[str]:
    """The weights a training graph updates (its inputs of role ``weight``), in graph order."""
    return [value.name for value in model.graph.input if props(value.metadata_props).get(ROLE) == Role.WEIGHT]


def write_delta(path: str | os.PathLike, delta: Mapping[str, np.ndarray], samples: int = 1) -> Path:
    """Write ``delta`` (weight name -> difference) and the number of samples it was trained on, atomically."""
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise InvalidOptionError(f"samples={samples!r}: give the number of training samples behind the delta (>= 1)")
    arrays = {name: np.asarray(value, np.float64) for name, value in delta.items()}
    return write_archive(path, arrays, _DELTA, {"format": FORMAT, "samples": int(samples)}, "delta path")


def read_delta(path: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]] | None = None
               ) -> tuple[dict[str, np.ndarray], int]:
    """The delta and sample count ``write_delta`` wrote; with ``shapes`` (weight -> shape), checked to hold
    exactly those weights in those shapes."""
    delta, header = read_archive(path, _DELTA, FORMAT, DeltaError, "delta", "; write it with Trainer.export_delta")
    if shapes is not None:
        if set(delta) != set(shapes):
            raise DeltaError(f"{path} holds weights {sorted(set(delta) ^ set(shapes))} that this training graph does "
                             "not train (or lacks them): load deltas of a conversion with the same trained weights")
        wrong = [name for name, value in delta.items() if value.shape != tuple(shapes[name])]
        if wrong:
            raise DeltaError(f"{path}: weights {wrong} have other shapes than this training graph's")
    return delta, int(header["samples"])


def average_deltas(paths: Sequence[str | os.PathLike]) -> tuple[dict[str, np.ndarray], int]:
    """FedAvg's server step: the deltas of ``paths`` averaged, each weighted by its sample count; and the total
    count. Every delta must hold the same weights in the same shapes."""
    if not paths:
        raise InvalidOptionError("average_deltas: give at least one delta file")
    first, total = read_delta(paths[0])
    shapes = {name: value.shape for name, value in first.items()}
    summed = {name: value * total for name, value in first.items()}
    for path in paths[1:]:
        delta, samples = read_delta(path, shapes)
        for name, value in delta.items():
            summed[name] += value * samples
        total += samples
    return {name: value / total for name, value in summed.items()}, total
