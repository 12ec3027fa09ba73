"""NonMaxSuppression: evaluated eagerly by the importer (inference, the ONNX node suite).

Its output size (how many boxes survive) depends on the box and score values, so it cannot be
part of a traced training graph: tracing it raises a ``ShapeError`` naming the node. Detection
models train on their heads' raw outputs; NMS belongs to post-processing.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ....errors import ShapeError
from ..registry import converter


def _corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """[..., 4] boxes as (y_min, x_min, y_max, x_max) whatever the corner order or format."""
    if center_point_box:
        x, y, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)
    return np.stack([np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1)


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of one corner box with each of ``others`` (0 for empty boxes)."""
    low, high = np.maximum(box[:2], others[:, :2]), np.minimum(box[2:], others[:, 2:])
    inter = np.prod(np.clip(high - low, 0, None), axis=-1)
    areas = np.prod(others[:, 2:] - others[:, :2], axis=-1)
    union = np.prod(box[2:] - box[:2]) + areas - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((inter > 0) & (union > 0), inter / union, 0.0)


def _select(boxes: np.ndarray, scores: np.ndarray, limit: int, iou: float, threshold: float | None) -> list[int]:
    """Greedy selection for one batch row and class: best score first (ties: lower index)."""
    order = [i for i in np.argsort(-scores, kind="stable") if threshold is None or scores[i] > threshold]
    chosen: list[int] = []
    for index in order:
        if len(chosen) >= limit:
            break
        if not chosen or not np.any(_iou(boxes[index], boxes[chosen]) > iou):
            chosen.append(int(index))
    return chosen


def _numpy(value) -> np.ndarray:
    return value.detach().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def _scalar(value, default):
    return default if value is None or np.size(value) == 0 else np.asarray(value).reshape(-1)[0].item()


@converter("NonMaxSuppression", static=(2, 3, 4))
def non_max_suppression(ctx, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
                        score_threshold=None):
    """[num_selected, 3] indices (batch, class, box) of the boxes kept per batch row and class."""
    if get_proxy_mode() is not None:
        raise ShapeError(
            f"NonMaxSuppression node '{ctx.name}': its output size depends on the box and score values, so it "
            "cannot be traced into a training graph; train on the outputs in front of it (make the scores and "
            "boxes the model's outputs) and run NMS in post-processing"
        )
    boxes = _corners(_numpy(boxes), ctx.attr("center_point_box", 0))
    scores = _numpy(scores)
    limit = max(int(_scalar(max_output_boxes_per_class, 0)), 0)
    iou = float(_scalar(iou_threshold, 0.0))
    threshold = None if score_threshold is None or np.size(score_threshold) == 0 else float(_scalar(score_threshold, 0))
    selected = [(b, c, i) for b in range(scores.shape[0]) for c in range(scores.shape[1])
                for i in _select(boxes[b], scores[b, c], limit, iou, threshold)]
    return torch.tensor(selected, dtype=torch.int64).reshape(-1, 3)
