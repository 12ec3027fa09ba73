"""A step of a compiled training graph (onnx-mlir) against onnxruntime's step on the same graph and state.

The tolerance is the zoo's: ``assert_steps_match``'s rtol of each tensor's scale; where an output is
ill-conditioned in float32 (a sum that cancels), the compiled output is compared with the float64 graph's
instead, within ``NOISE`` + ``NOISE_FACTOR`` x onnxruntime's own float32 error (``zoo.harness``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from zoo.harness import NOISE, NOISE_FACTOR

import bridge
from bridge.tools.verify import as_float64
from helpers.oracle import step_outputs
from helpers.reference import assert_close_to_scale, assert_steps_match


def step_mismatches(source: onnx.ModelProto, options: Mapping[str, Any], got: Mapping[str, np.ndarray],
                    want: Mapping[str, np.ndarray], feed: Mapping[str, np.ndarray], target: np.ndarray,
                    what: str = "") -> dict[str, str]:
    """The outputs of ``got`` (the compiled step) off onnxruntime's ``want`` or missing, with a message
    each; empty when every output matches. ``source`` and ``options`` (``bridge.to_training_onnx``'s, including
    ``dynamic_batch``) rebuild the float64 graph, stepped on ``feed`` (batch and noise) and ``target``,
    for the outputs that differ from onnxruntime's by more than ``assert_steps_match`` allows."""
    messages = {key: f"{what}: {key} missing" for key in want if key not in got}
    off = []
    for key in want.keys() & got.keys():
        try:
            assert_steps_match([{key: got[key]}], [{key: want[key]}])
        except AssertionError:
            off.append(key)
    if not off:
        return messages
    tm64 = bridge.to_training_onnx(as_float64(source), **options)
    wide = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feed.items()}
    want64 = step_outputs(tm64, wide, target.astype(np.float64))
    for key in sorted(off):
        expected = want64[key]
        error = np.abs(np.asarray(want[key], np.float64) - expected) if np.issubdtype(expected.dtype, np.floating) else 0
        try:
            assert_close_to_scale(got[key], expected, 1e-5, floor=NOISE + NOISE_FACTOR * float(np.max(error, initial=0.0)),
                                  err_msg=f"{what}: {key} vs float64 (onnxruntime's float32 error x {NOISE_FACTOR})")
        except AssertionError as exc:
            messages[key] = str(exc)
    return messages
