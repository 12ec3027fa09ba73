"""Stage 8, runtime: run training steps of a training ONNX model in onnxruntime.

``TrainingSession`` keeps the state (weights, buffers, optimizer state, ``step``, ``lr``),
feeds it with a batch, and feeds every ``updated_<x>`` output back as ``<x>``.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx

UPDATED = "updated_"


class TrainingSession:
    """Train with a training ONNX model: ``session.step(inputs, target)`` -> outputs."""

    def __init__(self, model: onnx.ModelProto | str, state: Mapping[str, np.ndarray], providers=None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        self._session = ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
        self.output_names = [o.name for o in self._session.get_outputs()]
        self.state = {name: np.asarray(value) for name, value in state.items()}

    @property
    def lr(self) -> float:
        return float(self.state["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.state["lr"] = np.asarray(value, dtype=self.state["lr"].dtype)

    def step(self, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict[str, np.ndarray]:
        """Run one training step; returns every output (loss, grad_*, updated_*)."""
        feed = dict(self.state)
        feed.update(inputs)
        feed["target"] = target
        results = dict(zip(self.output_names, self._session.run(self.output_names, feed)))
        for name, value in results.items():
            if name.startswith(UPDATED):
                self.state[name[len(UPDATED):]] = value
        return results
