"""Stage 8, runtime: run training steps of a training ONNX model in onnxruntime.

``StepSession`` keeps the state (weights, buffers, optimizer state, ``step``, ``lr``),
feeds it with a batch, and feeds every ``updated_<x>`` output back as ``<x>``; a backend
only says how to run one step (``TrainingSession``: onnxruntime; ``bridge.runtime_iree``: IREE).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np
import onnx

UPDATED = "updated_"


class StepSession(ABC):
    """Training state plus ``step(inputs, target)``; subclasses implement ``_run``."""

    def __init__(self, state: Mapping[str, np.ndarray]):
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
        results = self._run(feed)
        for name, value in results.items():
            if name.startswith(UPDATED):
                self.state[name[len(UPDATED):]] = value
        return results

    @abstractmethod
    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the training graph on ``feed`` (every graph input by name); outputs by name."""


class TrainingSession(StepSession):
    """Train with a training ONNX model in onnxruntime: ``session.step(inputs, target)`` -> outputs."""

    def __init__(self, model: onnx.ModelProto | str, state: Mapping[str, np.ndarray], providers=None):
        import onnxruntime as ort

        super().__init__(state)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        self._session = ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
        self.output_names = [o.name for o in self._session.get_outputs()]

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self._session.run(self.output_names, feed)))
