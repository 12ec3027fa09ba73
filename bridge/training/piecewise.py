"""Run a training step whose graph is cut into pieces (``bridge.tools.pieces.split``), piece after piece.

Each piece is fed the graph inputs and earlier pieces' outputs it reads; a value pieces compute is dropped
once the last piece reading it has run. With in_place state (``StepSession.in_place``), each old state array
is dropped too, from the feed and from the session's state, once the last piece reading it has run: the new
state of each later piece then takes the memory of the old state it replaces, instead of the whole new state
sitting beside the whole old one at the step's end. onnx-mlir's and onnxruntime's sessions share this loop.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .feed_checks import StepStateLostError


class PieceNames(Protocol):
    """What the loop needs to know of a piece: the names it reads and returns, in its call's order."""

    input_names: list[str]
    output_names: list[str]


@dataclass(frozen=True)
class LoadedPiece:
    """One loaded piece (a runtime's session of it) and the names it takes and returns, in its call's order."""

    session: object
    input_names: list[str]
    output_names: list[str]


def released_after(pieces: Sequence[PieceNames], outputs: list[str], inputs: list[str] | None = None) -> list[list[str]]:
    """Per piece, the values pieces compute (else the graph ``inputs`` given) that no later piece reads and
    the graph does not return: dropped once that piece has run, so that a step holds each piece's results
    only as long as it needs them."""
    last_reader = {name: index for index, piece in enumerate(pieces) for name in [*piece.output_names, *piece.input_names]}
    dropped = set(inputs) if inputs is not None else {name for piece in pieces for name in piece.output_names} - set(outputs)
    released: list[list[str]] = [[] for _ in pieces]
    for name in sorted(dropped & set(last_reader)):
        released[last_reader[name]].append(name)
    return released


class PiecewiseStep:
    """The pieces of a step, called in turn by ``run_piece``, and what each one's run releases."""

    def __init__(self, pieces: list[LoadedPiece], output_names: list[str], in_place: list[str],
                 run_piece: Callable[[LoadedPiece, dict[str, np.ndarray]], Sequence[np.ndarray]], in_place_option: str):
        """``in_place``: the state inputs released as the pieces run ([]: none); ``run_piece`` returns a piece's
        outputs in its ``output_names``' order; ``in_place_option`` names the option that made the state
        in_place, for ``StepStateLostError``'s message."""
        self.pieces, self.output_names, self.run_piece, self.in_place_option = pieces, output_names, run_piece, in_place_option
        self.released = released_after(pieces, output_names)
        self.state_released = released_after(pieces, [], in_place)

    def __call__(self, feed: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's outputs for ``feed``; in_place state is deleted from ``feed`` and ``state`` as it goes.
        A piece that fails after some state was deleted raises ``StepStateLostError``."""
        values = dict(feed)
        gone: list[str] = []  # state released by the pieces run so far
        for index, piece in enumerate(self.pieces):
            try:
                results = self.run_piece(piece, values)
            except Exception as exc:
                if not gone:
                    raise
                raise StepStateLostError(f"piece {index} of the step failed ({exc}) after the session released "
                                         f"{len(gone)} state arrays it updates in place ({self.in_place_option}), "
                                         f"e.g. {gone[0]!r}: restore the state from a checkpoint") from exc
            values.update(zip(piece.output_names, results, strict=True))
            gone += self.state_released[index]
            for name in self.released[index]:
                del values[name]
            for name in self.state_released[index]:  # the session's own reference too (step()'s feed holds one)
                del values[name], feed[name], state[name]
        return {name: values[name] for name in self.output_names}
