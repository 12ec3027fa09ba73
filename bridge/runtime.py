"""Stage 8, runtime: run training steps of a training ONNX model in onnxruntime.

``StepSession`` keeps the state (weights, buffers, optimizer state, ``step``, ``lr``),
feeds it with a batch, and feeds every ``updated_<x>`` output back as ``<x>``; a backend
only says how to run one step (``TrainingSession``: onnxruntime; ``bridge.runtime_iree``: IREE).
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Mapping

import numpy as np
import onnx

UPDATED = "updated_"
RANDOM_INPUTS = "bridge.random_inputs"  # model metadata: JSON list of the noise inputs drawn every step


class StepSession(ABC):
    """Training state plus ``step(inputs, target)``; subclasses implement ``_run``."""

    def __init__(self, state: Mapping[str, np.ndarray], seed: int | None = None):
        self.state = {name: np.asarray(value) for name, value in state.items()}
        self.random_inputs: dict[str, tuple[list, np.dtype]] = {}  # name -> (shape, dtype); None dims = batch
        self._rng = np.random.default_rng(seed)

    @property
    def lr(self) -> float:
        return float(self.state["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self.state["lr"] = np.asarray(value, dtype=self.state["lr"].dtype)

    def step(self, inputs: Mapping[str, np.ndarray], target: np.ndarray) -> dict[str, np.ndarray]:
        """Run one training step; returns every output (loss, grad_*, updated_*)."""
        feed = dict(self.state)
        for name, (shape, dtype) in self.random_inputs.items():
            if name not in inputs:  # uniform [0, 1) noise of random ops (e.g. Dropout), fresh each step
                feed[name] = self._rng.random([len(target) if d is None else d for d in shape]).astype(dtype)
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

    def __init__(self, model: onnx.ModelProto | str, state: Mapping[str, np.ndarray], providers=None,
                 seed: int | None = None):
        import onnxruntime as ort

        super().__init__(state, seed)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        self._session = ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
        self.output_names = [o.name for o in self._session.get_outputs()]
        random = json.loads(self._session.get_modelmeta().custom_metadata_map.get(RANDOM_INPUTS, "[]"))
        for value in self._session.get_inputs():
            if value.name in random:
                shape = [d if isinstance(d, int) else None for d in value.shape]
                self.random_inputs[value.name] = (shape, np.float64 if value.type == "tensor(double)" else np.float32)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self._session.run(self.output_names, feed)))
