"""Step-time checks of what a session is fed, and of what a step produced.

``StepChecks`` is read from a training (or eval) graph: the shape and dtype of every data
input and of ``target`` (the symbolic batch dim ``batch`` must be one size across them), and,
for a loss on class indices, the class count and ``ignore_index`` (model metadata written by
``to_training_onnx``). A bad batch raises ``StepInputError`` before anything runs.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from ..contract import DATA_ROLES, OPTIMIZER_NAME, OPTIMIZER_OPTIONS, ROLE, TARGET_CLASSES, UPDATED_PREFIX, Role, props
from ..errors import BridgeError, InvalidOptionError

NONFINITE_POLICIES = ("raise", "skip", "ignore")

Shape = list  # ints, or a str for a symbolic dim


class StepInputError(BridgeError, ValueError):
    """A batch fed to a session has a wrong name, dtype, shape, a non-finite value or a class index out of range."""


class NonFiniteError(BridgeError, FloatingPointError):
    """A step produced a non-finite loss or updated value (the session's state was left unchanged)."""


class StepStateLostError(BridgeError, RuntimeError):
    """A step run in pieces with in_place state (a module compiled with ``in_place=True``, a
    ``TrainingSession(in_place=True)``) failed after it had released state it replaces."""


@dataclass(frozen=True)
class StepChecks:
    """What a session checks before a step: names, dtypes, shapes, finiteness, class range."""

    specs: dict[str, tuple[Shape, np.dtype]]  # data inputs and target
    optional: frozenset[str] = frozenset()  # inputs that may be given or drawn (random noise)
    classes: int | None = None
    ignore_index: int | None = None

    @property
    def required(self) -> list[str]:
        return [name for name in self.specs if name not in self.optional]

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> StepChecks:
        """The checks of a bridge training or eval graph (``bridge.role`` of its inputs)."""
        specs, optional = {}, set()
        for value in model.graph.input:
            role = props(value.metadata_props).get(ROLE)
            if role in DATA_ROLES:
                tensor_type = value.type.tensor_type
                shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]
                specs[value.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
                if role == Role.RANDOM:
                    optional.add(value.name)
        meta = {p.key: p.value for p in model.metadata_props}
        target = json.loads(meta.get(TARGET_CLASSES, "null")) or {}
        return cls(specs, frozenset(optional), target.get("classes"), target.get("ignore_index"))

    def check(self, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> None:
        """Raise ``StepInputError`` naming the first problem of this batch."""
        fed = {**inputs, "target": target}
        missing = [name for name in self.required if name not in fed]
        unknown = sorted(set(fed) - set(self.specs))
        if missing or unknown:
            raise StepInputError(f"the batch lacks inputs {missing} / has unknown inputs {unknown}; "
                                 f"the graph takes {self.required}")
        sizes: dict[str, tuple[int, str]] = {}
        for name, value in fed.items():
            self._check_one(name, np.asarray(value), sizes)
        if self.classes is not None and np.issubdtype(np.asarray(target).dtype, np.integer):
            self._check_classes(np.asarray(target))

    def _check_one(self, name: str, value: np.ndarray, sizes: dict[str, tuple[int, str]]) -> None:
        shape, dtype = self.specs[name]
        if value.dtype != dtype:
            raise StepInputError(f"input '{name}' has dtype {value.dtype}, the graph takes {dtype}: "
                                 f"pass it as .astype(np.{dtype.name})")
        if value.ndim != len(shape) or any(isinstance(d, int) and d != n for d, n in zip(shape, value.shape, strict=True)):
            raise StepInputError(f"input '{name}' has shape {list(value.shape)}, the graph takes {shape}")
        for want, got in zip(shape, value.shape, strict=True):
            if isinstance(want, str):
                seen = sizes.setdefault(want, (got, name))
                if seen[0] != got:
                    raise StepInputError(f"dim '{want}' is {seen[0]} in '{seen[1]}' but {got} in '{name}': "
                                         "every input and the target must hold the same batch")
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise StepInputError(f"input '{name}' holds {int((~np.isfinite(value)).sum())} NaN/inf value(s)")

    def _check_classes(self, target: np.ndarray) -> None:
        bad = (target < 0) | (target >= self.classes)
        if self.ignore_index is not None:
            bad &= target != self.ignore_index
        if bad.any():
            raise StepInputError(
                f"target holds class indices outside [0, {self.classes}) (e.g. {int(target[bad].flat[0])}, "
                f"{int(bad.sum())} in all); ignore_index is {self.ignore_index}"
            )


def nonfinite_outputs(results: Mapping[str, np.ndarray], names: list[str]) -> list[str]:
    """The outputs among ``names`` that hold a NaN or an infinity."""
    with np.errstate(over="ignore", invalid="ignore"):  # a sum of squares past the dtype's range is expected
        return [name for name in names if not _finite(np.asarray(results[name]))]


def _finite(value: np.ndarray) -> bool:
    """Whether every element of ``value`` is finite (not a float: True).

    One read of a float32/float64 tensor: the sum of its squares (a BLAS dot) is finite only if every
    element is, since a NaN or an infinity squared is NaN or +inf and stays so through every sum of
    non-negative terms, in any order of summation. A non-finite sum (such an element, or squares summing
    past the dtype's range) is settled by the exact ``np.isfinite`` scan. The dot is faster than
    ``np.isfinite(x).all()``, which writes a boolean array first."""
    if value.dtype.kind != "f":  # dtype.kind: np.issubdtype is slower
        return True
    if value.dtype in _DOT_DTYPES:
        flat = value.reshape(-1)
        if np.isfinite(np.dot(flat, flat)):
            return True
    return bool(np.isfinite(value).all())


_DOT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # BLAS's: a float16 dot is numpy's slow loop


# Adam/AdamW without amsgrad update a weight as p + s * exp_avg / (sqrt(exp_avg_sq) + eps') (bridge.pipeline.optimizers
# ._adam). Over a finite exp_avg_sq the denominator is finite and >= 0, so a NaN/inf exp_avg makes the weight
# NaN/inf (s * inf is +-inf, or NaN for s = 0; +-inf / d is +-inf, or NaN), and checking the weight and
# exp_avg_sq covers exp_avg. Not the reverse: an inf exp_avg_sq gives exp_avg / inf = 0 and a finite weight.
_COVERED_SLOT = {"adam": "exp_avg", "adamw": "exp_avg"}


def covered_outputs(model: onnx.ModelProto) -> frozenset[str]:
    """The ``updated_*`` outputs of a training graph that are non-finite only where another checked
    output is (so the non-finite check need not read them): ``updated_<weight>.exp_avg`` under Adam/AdamW
    without amsgrad, where ``updated_<weight>`` and ``updated_<weight>.exp_avg_sq`` are outputs."""
    meta = props(model.metadata_props)
    slot = _COVERED_SLOT.get(meta.get(OPTIMIZER_NAME, ""))
    if slot is None or json.loads(meta.get(OPTIMIZER_OPTIONS, "{}")).get("amsgrad", True):
        return frozenset()
    outputs = {value.name for value in model.graph.output}
    suffix = f".{slot}"
    return frozenset(name for name in outputs if name.startswith(UPDATED_PREFIX) and name.endswith(suffix)
                     and {name[:-len(suffix)], f"{name[:-len(suffix)]}.exp_avg_sq"} <= outputs)


def check_policy(on_nonfinite: str) -> str:
    """``on_nonfinite`` validated: what a step does when its loss or an updated value is not finite."""
    if on_nonfinite not in NONFINITE_POLICIES:
        raise InvalidOptionError(f"on_nonfinite='{on_nonfinite}' is not one of {NONFINITE_POLICIES}")
    return on_nonfinite
