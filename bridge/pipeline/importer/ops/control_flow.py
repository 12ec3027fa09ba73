"""Control flow: If, Loop and Scan, decided and unrolled at import.

bridge's training graph is straight-line code, so control flow is resolved while the importer
interprets the model (docs/control_flow.md):

- ``If``: the condition must be known before the model runs (a constant, or folded from
  constants and static shapes); the chosen branch is interpreted in place, reading outer-scope
  values. A condition computed from data is refused (a ``ShapeError`` naming the node).
- ``Loop``: unrolled, the body interpreted once per iteration. The trip count and the condition
  (the node's and the one the body returns each iteration) must be known before the model runs;
  loop-carried values and per-iteration scan outputs may be data (traced like any op).
- ``Scan``: unrolled over the scan axis of its inputs (``scan_input_axes``/``_directions``,
  ``scan_output_axes``/``_directions``; opset 8's batched form one batch row at a time).

``MAX_UNROLL`` (default 1000, environment variable ``BRIDGE_MAX_UNROLL``) bounds the number of
iterations of one Loop or Scan node: past it the import stops with a ``ShapeError`` instead of
building an enormous graph.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ....errors import ShapeError
from ..registry import NodeContext, converter

MAX_UNROLL = int(os.environ.get("BRIDGE_MAX_UNROLL", "1000"))


PIN_HINT = ("if it derives from a graph input that always has the same value (a flag), pin that input: "
            "constant_inputs={'<input>': value} in bridge.to_training_onnx, --constant-input <input>=value "
            "with bridge convert")


def _known(ctx: NodeContext, value, index: int, what: str):
    """Input ``index`` of the node, which must be known before the model runs, as numpy."""
    if isinstance(value, torch.Tensor):
        raise ShapeError(
            f"{ctx.node.op_type} node '{ctx.name}': input {index} ('{ctx.node.input[index]}', {what}) must be "
            "known before the model runs, but it is computed from data; bridge resolves control flow at import "
            "(the training graph is straight-line code), so it must be a constant or computed from constants "
            f"and static shapes; {PIN_HINT}"
        )
    return value


def _known_bool(ctx: NodeContext, value, what: str, index: int | None = None) -> bool:
    """A condition known before the model runs, as a Python bool."""
    if index is not None:
        value = _known(ctx, value, index, what)
    elif isinstance(value, torch.Tensor):
        raise ShapeError(
            f"{ctx.node.op_type} node '{ctx.name}': {what} is computed from data; bridge resolves control "
            "flow at import (the training graph is straight-line code), so it must be known before the "
            f"model runs (a constant, or computed from constants and static shapes); {PIN_HINT}"
        )
    return bool(np.asarray(value).reshape(-1)[0])


def _check_bound(ctx: NodeContext, iterations: int) -> None:
    if iterations > MAX_UNROLL:
        raise ShapeError(
            f"{ctx.node.op_type} node '{ctx.name}': {iterations} iterations exceed bridge's unrolling bound "
            f"of {MAX_UNROLL} (raise it with the environment variable BRIDGE_MAX_UNROLL or "
            "bridge.pipeline.importer.ops.control_flow.MAX_UNROLL; the training graph grows with every iteration)"
        )


def _stack(values: list, axis: int = 0):
    """Per-iteration values stacked along a new ``axis`` (numpy if every one is known up front)."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.stack(values, axis=axis)
    tensors = [v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v, copy=True)) for v in values]
    return torch.stack(tensors, dim=axis % (tensors[0].dim() + 1))


@converter("If", static=(0,), raw=True)
def if_(ctx, cond):
    """The branch chosen by a condition known before the model runs, interpreted in place."""
    branch = ctx.attr("then_branch") if _known_bool(ctx, cond, "the condition", 0) else ctx.attr("else_branch")
    return tuple(ctx.run_graph(branch, {}))


@converter("Loop", static=(0, 1), raw=True)
def loop(ctx, trip_count=None, cond=None, *carried):
    """``for i in range(M) while cond``: the body unrolled, loop-carried values threaded through,
    the body's scan outputs stacked along a new axis 0."""
    body = ctx.attr("body")
    inputs = [i.name for i in body.input]
    limit = None if trip_count is None else int(np.asarray(_known(ctx, trip_count, 0, "the trip count")).reshape(-1)[0])
    if limit is None and cond is None:
        raise ShapeError(f"Loop node '{ctx.name}': neither a trip count nor a condition: the loop never ends")
    keep_going = True if cond is None else _known_bool(ctx, cond, "the initial condition", 1)
    state, scans, i = list(carried), [], 0
    while keep_going and (limit is None or i < limit):
        _check_bound(ctx, i + 1)
        bindings = dict(zip(inputs, [np.asarray(i, np.int64), np.asarray(keep_going), *state], strict=True))
        outputs = ctx.run_graph(body, bindings)
        keep_going = _known_bool(ctx, outputs[0], "the condition the body returns")
        state, scans = outputs[1:1 + len(carried)], scans + [outputs[1 + len(carried):]]
        i += 1
    count = len(body.output) - 1 - len(carried)
    if count and not scans:
        raise ShapeError(f"Loop node '{ctx.name}': zero iterations, so its scan outputs have no known shape")
    return tuple(state) + tuple(_stack([s[k] for s in scans]) for k in range(count))


def _slice(value, axis: int, index: int):
    return np.take(value, index, axis=axis) if isinstance(value, np.ndarray) else value.select(axis, index)


def _scan(ctx, states: list, xs: list, directions: list[int] | None = None) -> tuple[list, list]:
    """One Scan (opset 9 form) over ``xs``: the final states and the stacked scan outputs."""
    body = ctx.attr("body")
    names = [i.name for i in body.input]
    axes = [a % np.ndim(x) for a, x in zip(ctx.attr("scan_input_axes", [0] * len(xs)), xs, strict=True)]
    directions = directions or ctx.attr("scan_input_directions", [0] * len(xs))
    lengths = {int(x.shape[a]) for x, a in zip(xs, axes, strict=True)}
    if len(lengths) != 1:
        raise ShapeError(f"Scan node '{ctx.name}': scan inputs of different lengths {sorted(lengths)}")
    length = lengths.pop()
    _check_bound(ctx, length)
    steps = []
    for t in range(length):
        slices = [_slice(x, a, length - 1 - t if d else t) for x, a, d in zip(xs, axes, directions, strict=True)]
        outputs = ctx.run_graph(body, dict(zip(names, [*states, *slices], strict=True)))
        states, steps = outputs[:len(states)], steps + [outputs[len(states):]]
    count = len(body.output) - len(states)
    out_axes = ctx.attr("scan_output_axes", [0] * count)
    out_directions = ctx.attr("scan_output_directions", [0] * count)
    if count and not steps:
        raise ShapeError(f"Scan node '{ctx.name}': an empty scan, so its scan outputs have no known shape")
    scans = []
    for k in range(count):
        values = [s[k] for s in steps]
        scans.append(_stack(values[::-1] if out_directions[k] else values, out_axes[k]))
    return list(states), scans


@converter("Scan", raw=True)
def scan(ctx, *args):
    """The body applied along the scan axis of the scan inputs, states threaded through."""
    count = ctx.attr("num_scan_inputs")
    if ctx.opset >= 9:
        states, xs = list(args[:len(args) - count]), list(args[len(args) - count:])
        final, scans = _scan(ctx, states, xs)
        return tuple(final + scans)
    return _scan_batched(ctx, args[0], list(args[1:len(args) - count]), list(args[len(args) - count:]))


def _scan_batched(ctx, lengths, states: list, xs: list) -> tuple:
    """Opset 8's Scan: dim 0 of every input is a batch, scanned row by row along axis 1 (as axis 0
    of the row); ``sequence_lens`` must be absent or the full length."""
    if lengths is not None:
        if isinstance(lengths, torch.Tensor) or np.any(np.asarray(lengths) != xs[0].shape[1]):
            raise ctx.unsupported("sequence_lens shorter than the scan inputs (or computed from data)")
    if ctx.has_attr("axes"):
        raise ctx.unsupported("opset 8's axes attribute")
    rows = []
    for b in range(int(xs[0].shape[0])):
        final, scans = _scan(ctx, [_slice(s, 0, b) for s in states], [_slice(x, 0, b) for x in xs],
                             ctx.attr("directions"))
        rows.append(final + scans)
    return tuple(_stack([r[k] for r in rows]) for k in range(len(rows[0])))
