"""Recurrent ONNX ops: RNN, GRU, LSTM, unrolled over the (static) sequence length.

Every direction (forward, reverse, bidirectional), both layouts, initial states, LSTM
peepholes, ``clip``, ``input_forget``, GRU's ``linear_before_reset`` and the ONNX activation
functions (with ``activation_alpha``/``activation_beta``) are supported. ``sequence_lens``
is accepted only when it is a constant equal to the sequence length for every batch entry
(padded sequences would need per-entry masking, which no exporter of a fixed-shape model emits).
Gate orders are ONNX's: LSTM ``i, o, f, c``, GRU ``z, r, h``.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..registry import NodeContext, converter
from .activation import HARD_SIGMOID_ALPHA, LEAKY_RELU_ALPHA, elu_formula, leaky_relu_formula

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}

# name -> (number of parameters it takes from activation_alpha/beta, default alpha, default beta, fn)
_ACTIVATIONS: dict[str, tuple[int, float, float, Callable]] = {
    "Sigmoid": (0, 0.0, 0.0, lambda x, a, b: torch.sigmoid(x)),
    "Tanh": (0, 0.0, 0.0, lambda x, a, b: torch.tanh(x)),
    "Relu": (0, 0.0, 0.0, lambda x, a, b: F.relu(x)),
    "Softsign": (0, 0.0, 0.0, lambda x, a, b: x / (1 + x.abs())),
    "Softplus": (0, 0.0, 0.0, lambda x, a, b: F.softplus(x)),
    "Affine": (2, 1.0, 0.0, lambda x, a, b: a * x + b),
    "LeakyRelu": (1, LEAKY_RELU_ALPHA, 0.0, lambda x, a, b: leaky_relu_formula(x, a)),
    "ThresholdedRelu": (1, 1.0, 0.0, lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x))),
    "ScaledTanh": (2, 1.0, 1.0, lambda x, a, b: a * torch.tanh(b * x)),
    "HardSigmoid": (2, HARD_SIGMOID_ALPHA, 0.5, lambda x, a, b: torch.clamp(a * x + b, 0.0, 1.0)),
    "Elu": (1, 1.0, 0.0, lambda x, a, b: elu_formula(x, a)),
}


def _activations(ctx: NodeContext, directions: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """One callable per (direction, activation slot), with alpha/beta consumed in order."""
    names = ctx.attr("activations") or _DEFAULT_ACTIVATIONS[ctx.node.op_type] * directions
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    alphas = list(ctx.attr("activation_alpha") or [])
    betas = list(ctx.attr("activation_beta") or [])
    fns = []
    for name in names:
        match = next((k for k in _ACTIVATIONS if k.lower() == name.lower()), None)
        if match is None:
            raise ctx.unsupported(f"activation '{name}'")
        count, alpha, beta, fn = _ACTIVATIONS[match]
        if count >= 1 and alphas:
            alpha = alphas.pop(0)
        if count >= 2 and betas:
            beta = betas.pop(0)
        fns.append(lambda x, fn=fn, a=alpha, b=beta: fn(x, a, b))
    per_direction = len(_DEFAULT_ACTIVATIONS[ctx.node.op_type])
    if len(fns) != per_direction * directions:
        raise ctx.unsupported(f"{len(fns)} activations for {directions} direction(s)")
    return fns


def _check_sequence_lens(ctx: NodeContext, sequence_lens, seq_len: int) -> None:
    if sequence_lens is None:
        return
    if not isinstance(sequence_lens, np.ndarray) or not np.all(sequence_lens == seq_len):
        raise ctx.unsupported("sequence_lens that differ from the sequence length (padded sequences)")


def _recur(ctx: NodeContext, x, w, r, b, initial, direction: int, acts, peephole=None) -> tuple[list, list]:
    """Run one direction over time; returns per-step hidden states and the final states."""
    op, hidden = ctx.node.op_type, r.shape[-1]
    gates = _GATES[op]
    clip = ctx.attr("clip")
    steps = range(x.shape[0] - 1, -1, -1) if direction else range(x.shape[0])
    # Input projections for every step at once: [T, B, gates*H].
    # (split/unbind rather than slicing: their backward is a concat, not a scatter)
    xw = torch.matmul(x, w.transpose(0, 1))
    wb, rb = torch.split(b, gates * hidden) if b is not None else (None, None)
    if wb is not None:
        xw = xw + wb
    xw = torch.unbind(xw)
    h = initial[0]
    c = initial[1] if op == "LSTM" else None
    outputs = [None] * x.shape[0]

    def clipped(v):
        return torch.clamp(v, -clip, clip) if clip is not None else v

    for t in steps:
        hr = torch.matmul(h, r.transpose(0, 1))
        if rb is not None:
            hr = hr + rb
        if op == "RNN":
            h = acts[0](clipped(xw[t] + hr))
        elif op == "GRU":
            xz, xr, xh = torch.split(xw[t], hidden, dim=-1)
            hz, hrr, hh = torch.split(hr, hidden, dim=-1)
            z = acts[0](clipped(xz + hz))
            reset = acts[0](clipped(xr + hrr))
            if ctx.attr("linear_before_reset", 0):
                candidate = acts[1](clipped(xh + reset * hh))
            else:
                rh = torch.matmul(reset * h, torch.split(r, hidden)[2].transpose(0, 1))
                if rb is not None:
                    rh = rh + torch.split(rb, hidden)[2]
                candidate = acts[1](clipped(xh + rh))
            h = (1 - z) * candidate + z * h
        else:
            xi, xo, xf, xc = torch.split(xw[t] + hr, hidden, dim=-1)
            if peephole is not None:
                pi, po, pf = torch.split(peephole, hidden)
                xi, xf = xi + pi * c, xf + pf * c
            i = acts[0](clipped(xi))
            f = 1 - i if ctx.attr("input_forget", 0) else acts[0](clipped(xf))
            c = f * c + i * acts[1](clipped(xc))
            if peephole is not None:
                xo = xo + po * c
            h = acts[0](clipped(xo)) * acts[2](c)
        outputs[t] = h
    return outputs, [h] if c is None else [h, c]


def _recurrent(ctx: NodeContext, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None):
    op = ctx.node.op_type
    layout = ctx.attr("layout", 0)
    if layout:
        x = x.transpose(0, 1)
        initial_h = None if initial_h is None else initial_h.transpose(0, 1)
        initial_c = None if initial_c is None else initial_c.transpose(0, 1)
    _check_sequence_lens(ctx, sequence_lens, x.shape[0])
    direction = ctx.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ctx.unsupported(f"direction '{direction}'")
    directions = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    acts = _activations(ctx, directions)
    per = len(_DEFAULT_ACTIVATIONS[op])
    zeros = x.new_zeros(directions, x.shape[1], hidden)
    initial_h = zeros if initial_h is None else initial_h
    initial_c = zeros if initial_c is None else initial_c
    w, r, initial_h, initial_c = (torch.unbind(t) for t in (w, r, initial_h, initial_c))
    b = [None] * directions if b is None else torch.unbind(b)
    p = [None] * directions if p is None else torch.unbind(p)
    ys, finals = [], []
    for d in range(directions):
        reverse = direction == "reverse" or d == 1
        outs, final = _recur(
            ctx, x, w[d], r[d], b[d], [initial_h[d], initial_c[d]], int(reverse), acts[d * per:(d + 1) * per], p[d]
        )
        ys.append(torch.stack(outs))  # [T, B, H]
        finals.append(final)
    y = torch.stack(ys, dim=1)  # [T, D, B, H]
    y_h = torch.stack([f[0] for f in finals])  # [D, B, H]
    results = [y, y_h]
    if op == "LSTM":
        results.append(torch.stack([f[1] for f in finals]))
    if layout:
        results = [y.permute(2, 0, 1, 3)] + [s.transpose(0, 1) for s in results[1:]]
    return tuple(results[: len(ctx.node.output)])


converter("RNN", "GRU", "LSTM", static=(4,))(_recurrent)
