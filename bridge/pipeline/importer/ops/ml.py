"""ai.onnx.ml ops of a linear classifier (scikit-learn's LogisticRegression through skl2onnx or
onnxmltools): LinearClassifier, Normalizer and ZipMap, as standard differentiable formulas.

LinearClassifier keeps its coefficients and intercepts in attributes; the importer lifts them into
the weights ``<node>.coefficients`` (flat, ``rows * features`` as the attribute holds them) and
``<node>.intercepts`` (``attribute_weights=``), so they train. Its scores are
``x @ coefficients.reshape(rows, features).T + intercepts``; one coefficient row with two class
labels (a binary model) scores the classes ``[-s, s]``. ``post_transform`` is then applied as
onnx's reference implementation does (NONE, LOGISTIC, SOFTMAX, SOFTMAX_ZERO, PROBIT).
onnxruntime differs in that binary case: it returns ``[1 - s, s]`` for NONE, SOFTMAX and
SOFTMAX_ZERO. The label output is the class label of the highest score (not differentiable);
string labels are not computed (the unused-output pruning leaves a string output out).

Normalizer divides each row by its MAX (the largest value, as the ONNX spec and onnxruntime; onnx's
reference evaluator takes the largest absolute value), L1 or L2 norm, and keeps a row whose norm
is 0 (onnxruntime; the reference gives the same zeros).
ZipMap's maps, one per row from class label to probability, are the ``[N, C]`` tensor of the
values in class-label order: the tensor a loss applies to.
"""
from __future__ import annotations

import math

import torch

from ....errors import ShapeError
from ..registry import converter
from .reduce import extremum

ML = "ai.onnx.ml"
SOFTMAX_ZERO_BAND = 1e-7  # SOFTMAX_ZERO leaves scores within this of 0 out of the exponentials (the reference)
# PROBIT is sqrt(2) * erfinv(2p - 1), with erfinv by Winitzki's approximation (a = 0.147), as the reference
PROBIT_A = 0.147
SQRT2 = 1.41421356


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 1-D input as one row (onnxruntime's reading), in floating point (integer features as float32)."""
    x = x.reshape(1, -1) if x.dim() == 1 else x
    return x if x.is_floating_point() else x.to(torch.float32)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's largest value, with ReduceMax's gradient (ties share it; no bool Cast for onnx-mlir)."""
    return extremum(True)(x, [1])


def _softmax_zero(scores: torch.Tensor) -> torch.Tensor:
    """Softmax in which a score within ``SOFTMAX_ZERO_BAND`` of 0 contributes ``score * exp(-max)``
    instead of ``exp(score - max)``; a row that sums to 0 is 0.5 everywhere (the reference)."""
    top = _row_max(scores)
    away = scores.abs() > SOFTMAX_ZERO_BAND
    values = torch.where(away, torch.exp(scores - top), scores * torch.exp(-top))
    total = values.sum(dim=1, keepdim=True)
    zero = total == 0
    return torch.where(zero, torch.full_like(values, 0.5), values / torch.where(zero, torch.ones_like(total), total))


def _probit(scores: torch.Tensor) -> torch.Tensor:
    """``sqrt(2) * erfinv(2p - 1)`` with the reference's approximation of erfinv; 0 where ``2p - 1`` is ±1."""
    y = 2 * scores - 1
    x = (1 - y) * (1 + y)
    edge = x == 0
    log = torch.log(torch.where(edge, torch.ones_like(x), x))
    v = 2 / (math.pi * PROBIT_A) + 0.5 * log
    root = torch.sqrt(-v + torch.sqrt(v * v - log / PROBIT_A))
    return torch.where(edge, torch.zeros_like(x), SQRT2 * torch.where(y < 0, -root, root))


POST_TRANSFORMS = {
    "NONE": lambda s: s,
    "LOGISTIC": torch.sigmoid,
    "SOFTMAX": lambda s: torch.softmax(s, dim=1),
    "SOFTMAX_ZERO": _softmax_zero,
    "PROBIT": _probit,
}


@converter("LinearClassifier", domain=ML, attribute_weights=("coefficients", "intercepts"))
def linear_classifier(ctx, x, coefficients=None, intercepts=None):
    """``(label, scores)``: see the module doc."""
    post_transform = ctx.attr("post_transform", "NONE")
    if post_transform not in POST_TRANSFORMS:
        raise ctx.unsupported(f"post_transform '{post_transform}' (ONNX defines {', '.join(POST_TRANSFORMS)})")
    if coefficients is None or intercepts is None:
        raise ctx.unsupported("a LinearClassifier without coefficients or intercepts (their count is the "
                              "number of score columns)")
    labels = ctx.attr("classlabels_ints") or ctx.attr("classlabels_strings") or []
    rows = intercepts.shape[0]
    x = _rows(x)
    if coefficients.shape[0] != rows * x.shape[1]:
        raise ShapeError(f"LinearClassifier node '{ctx.name}': its {coefficients.shape[0]} coefficients for {rows} "
                         f"score rows are {coefficients.shape[0] / rows:g} per row, but its input "
                         f"'{ctx.input_name(0)}' has {x.shape[1]} features (onnxruntime reads the first "
                         f"{rows * x.shape[1]} coefficients as {rows} rows of {x.shape[1]}, onnx's reference evaluator "
                         "fails): the model's input shape and coefficients disagree; give the "
                         "input the feature count the coefficients were fitted on")
    scores = x.to(coefficients.dtype) @ coefficients.reshape(rows, -1).T + intercepts
    if rows == 1 and len(labels) == 2:
        scores = torch.cat([-scores, scores], dim=1)
    elif scores.shape[1] != len(labels):
        raise ctx.unsupported(f"{rows} coefficient row(s) for {len(labels)} class label(s) (give one row per "
                              "class, or one row for two classes)")
    scores = POST_TRANSFORMS[post_transform](scores)
    if ctx.attr("classlabels_strings"):
        return None, scores
    classes = torch.tensor(labels, dtype=torch.int64)
    return classes[torch.argmax(scores, dim=1)], scores


@converter("Normalizer", domain=ML)
def normalizer(ctx, x):
    """Each row divided by its ``norm``: MAX (its largest value), L1 or L2; a row whose norm is 0 is kept."""
    norm = ctx.attr("norm", "MAX")
    x = _rows(x)
    if norm == "MAX":
        divisor = _row_max(x)
    elif norm == "L1":
        divisor = x.abs().sum(dim=1, keepdim=True)
    elif norm == "L2":
        divisor = torch.sqrt((x * x).sum(dim=1, keepdim=True))
    else:
        raise ctx.unsupported(f"norm '{norm}' (ONNX defines MAX, L1 and L2)")
    return x / torch.where(divisor == 0, torch.ones_like(divisor), divisor)


@converter("ZipMap", domain=ML)
def zip_map(ctx, x):
    """The probabilities themselves: the maps' values in class-label order (module doc)."""
    return x
