"""``bridge show``: a text summary of a training graph, and a self-contained HTML picture.

The picture collapses the graph by layer: one box per (phase, layer), laid out as a ladder,
row ``i`` = the ``i``-th forward layer, with its backward box beside it and the optimizer
boxes of the weights it reads beside that. Boxes are coloured by phase; arrows are the
values passed between boxes. Below the drawing, every node is listed per phase and layer.
No scripts or external resources: the file renders offline.
"""
from __future__ import annotations

import html
import json
from collections import Counter, defaultdict

from onnx import TensorProto

from ..contract import PHASES
from ..ir import TrainingGraph

PHASE_COLORS = {"forward": "#4c78a8", "loss": "#f58518", "backward": "#e45756", "optimizer": "#54a24b"}
_ROW, _BOX_H, _WIDE, _NARROW, _GAP = 34, 26, 250, 150, 40


def _shape(graph: TrainingGraph) -> dict[str, str]:
    shapes = {}
    for value in list(graph.model.graph.input) + list(graph.model.graph.output):
        tensor = value.type.tensor_type
        dims = [str(d.dim_value) if d.HasField("dim_value") else d.dim_param for d in tensor.shape.dim]
        shapes[value.name] = f"{TensorProto.DataType.Name(tensor.elem_type).lower()}[{', '.join(dims)}]"
    return shapes


def summary(graph: TrainingGraph) -> str:
    """Nodes per phase, op histogram per phase, weights with gradient/state, roles of inputs/outputs."""
    meta = graph.metadata
    lines = [
        f"training graph of '{meta.get('bridge.source_model', '?')}' "
        f"(sha256 {meta.get('bridge.source_sha256', '?')[:12]}), bridge {meta.get('bridge.version', '?')}",
        f"loss: {meta.get('bridge.loss', '?')} {meta.get('bridge.loss_options', '')}",
        f"optimizer: {meta.get('bridge.optimizer', '?')} {meta.get('bridge.optimizer_options', '')}",
        "",
        f"nodes: {sum(1 for _ in graph.nodes())}",
    ]
    for phase in PHASES:
        ops = Counter(node.op_type for node in graph.nodes(phase))
        histogram = ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"  {phase:<10}{sum(ops.values()):>6}  {histogram}")
    shapes = _shape(graph)
    lines += ["", f"weights: {len(graph.weights)}"]
    width = max((len(w) for w in graph.weights), default=0)
    for weight in graph.weights:
        state = ", ".join(graph.state_of(weight).values()) or "-"
        lines.append(
            f"  {weight:<{width}}  {shapes[weight]:<18} gradient {graph.gradients.get(weight, '-')}  "
            f"state {state}  -> {graph.updates.get(weight, '-')}"
        )
    for title, names in (("inputs", graph.graph_inputs), ("outputs", graph.outputs)):
        lines += ["", f"{title}: {len(names)}"]
        width = max((len(n) for n in names), default=0)
        lines += [f"  {name:<{width}}  {graph.role(name):<16} {shapes[name]}" for name in names]
    return "\n".join(lines) + "\n"


def _layout(graph: TrainingGraph) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(phase, layer) -> (x, y, width) of its box."""
    rows = {layer: i for i, layer in enumerate(graph.layers("forward"))}
    loss_row = len(rows)
    row_of: dict[tuple[str, str], int] = {}
    for layer in graph.layers("loss"):
        row_of[("loss", layer)] = loss_row
    for layer, row in rows.items():
        row_of[("forward", layer)] = row
    for layer in graph.layers("backward"):
        row_of[("backward", layer)] = rows.get(layer, loss_row)
    for layer in graph.layers("optimizer"):
        readers = [rows[n.layer] for n in graph.consumers(layer) if n.phase == "forward"]
        row_of[("optimizer", layer)] = min(readers, default=loss_row)
    x_of = {"forward": 10, "loss": 10, "backward": 10 + _WIDE + _GAP}
    boxes, used = {}, defaultdict(int)
    for (phase, layer), row in row_of.items():
        if phase == "optimizer":
            x = 10 + 2 * (_WIDE + _GAP) + used[row] * (_NARROW + 10)
            used[row] += 1
            boxes[(phase, layer)] = (x, 10 + row * _ROW, _NARROW)
        else:
            boxes[(phase, layer)] = (x_of[phase], 10 + row * _ROW, _WIDE)
    return boxes


def _edges(graph: TrainingGraph) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    edges = set()
    for node in graph.nodes():
        for value in node.inputs:
            source = graph.producer(value)
            if source is not None and (source.phase, source.layer) != (node.phase, node.layer):
                edges.add(((source.phase, source.layer), (node.phase, node.layer)))
    return edges


def _clip(text: str, width: float) -> str:
    limit = int(width / 6.5)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _path(a: tuple[float, float, float], b: tuple[float, float, float]) -> str:
    (x1, y1, w1), (x2, y2, w2) = a, b
    if x1 == x2:  # same column: from the bottom of one box to the top of the other, bowing left
        bow = 0 if abs(y2 - y1) <= _ROW else min(12 + 4 * abs(y2 - y1) / _ROW, 60)
        sy, ey = (y1 + _BOX_H, y2) if y2 > y1 else (y1, y2 + _BOX_H)
        sx, ex = x1 + w1 / 2, x2 + w2 / 2
        return f"M{sx:.0f},{sy:.0f} C{sx - bow * 3:.0f},{sy:.0f} {ex - bow * 3:.0f},{ey:.0f} {ex:.0f},{ey:.0f}"
    sx, ex = (x1 + w1, x2) if x2 > x1 else (x1, x2 + w2)
    sy, ey = y1 + _BOX_H / 2, y2 + _BOX_H / 2
    mid = (sx + ex) / 2
    return f"M{sx:.0f},{sy:.0f} C{mid:.0f},{sy:.0f} {mid:.0f},{ey:.0f} {ex:.0f},{ey:.0f}"


def _svg(graph: TrainingGraph) -> str:
    boxes = _layout(graph)
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for node in graph.nodes():
        groups[(node.phase, node.layer)].append(node)
    width = max(x + w for x, _, w in boxes.values()) + 10
    height = max(y for _, y, _ in boxes.values()) + _ROW + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, sans-serif" font-size="11">'
    ]
    for source, dest in sorted(_edges(graph)):
        parts.append(
            f'<path class="edge" d="{_path(boxes[source], boxes[dest])}" fill="none" '
            f'stroke="{PHASE_COLORS[source[0]]}" stroke-opacity="0.35" stroke-width="1.2"/>'
        )
    for (phase, layer), (x, y, w) in boxes.items():
        nodes = groups[(phase, layer)]
        ops = Counter(n.op_type for n in nodes)
        tooltip = f"{phase} {layer} ({nodes[0].kind}): {len(nodes)} nodes\n" + ", ".join(
            f"{op} {n}" for op, n in ops.most_common()
        )
        label = _clip(f"{layer} \u00b7 {nodes[0].kind} ({len(nodes)})", w - 8)
        parts.append(
            f'<g class="box" data-phase="{phase}" data-layer="{html.escape(layer)}">'
            f"<title>{html.escape(tooltip)}</title>"
            f'<rect x="{x}" y="{y}" width="{w}" height="{_BOX_H}" rx="4" fill="{PHASE_COLORS[phase]}"/>'
            f'<text x="{x + 5}" y="{y + 17}" fill="white">{html.escape(label)}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def to_html(graph: TrainingGraph) -> str:
    """A self-contained HTML page: header, legend, the collapsed drawing, the node listing."""
    title = f"bridge training graph: {graph.metadata.get('bridge.source_model', '')}"
    legend = "".join(
        f'<span class="chip" style="background:{color}">{phase} '
        f'({sum(1 for _ in graph.nodes(phase))} nodes)</span>'
        for phase, color in PHASE_COLORS.items()
    )
    listing = []
    for phase in PHASES:
        rows = []
        for layer in graph.layers(phase):
            nodes = list(graph.nodes(phase, layer))
            body = "".join(
                f"<tr><td>{html.escape(n.name)}</td><td>{n.op_type}</td>"
                f"<td>{html.escape(', '.join(n.inputs))}</td><td>{html.escape(', '.join(n.outputs))}</td></tr>"
                for n in nodes
            )
            rows.append(
                f"<details><summary>{html.escape(layer)} ({len(nodes)})</summary>"
                f"<table><tr><th>node</th><th>op</th><th>inputs</th><th>outputs</th></tr>{body}</table></details>"
            )
        listing.append(f'<h2 style="color:{PHASE_COLORS[phase]}">{phase}</h2>' + "".join(rows))
    meta = html.escape(json.dumps(graph.metadata, indent=1))
    return (
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:'DejaVu Sans',sans-serif;margin:16px} .chip{color:white;padding:2px 8px;"
        "margin-right:6px;border-radius:4px} table{border-collapse:collapse;font-size:12px}"
        "td,th{border:1px solid #ddd;padding:2px 6px;text-align:left} pre{font-size:11px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{legend}</p>"
        "<p>One box per layer and phase (node count in brackets; hover for its ops). Rows follow the forward "
        "layers; each layer's backward box and its weights' optimizer boxes sit on its row.</p>"
        f'<div id="graph">{_svg(graph)}</div>{"".join(listing)}'
        f"<h2>metadata</h2><pre>{meta}</pre></body></html>"
    )
