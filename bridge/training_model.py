"""The result of a conversion: the training ONNX model plus what is needed to start training."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .runtime import TrainingSession
from .trace import StepSignature


@dataclass
class TrainingModel:
    """A training-step ONNX model (``.model``) and its initial state.

    ``initial_state()`` gives a value for every graph input that is not data or target:
    the original weights and buffers, optimizer state as torch.optim initialises it,
    ``step`` (0) and ``lr``.
    """

    model: onnx.ModelProto
    signature: StepSignature
    initial_values: dict[str, np.ndarray] = field(repr=False)
    target_shape: tuple[int, ...] = ()
    target_dtype: np.dtype = np.dtype(np.int64)

    @property
    def weights(self) -> list[str]:
        return list(self.signature.weights)

    @property
    def data_inputs(self) -> list[str]:
        return list(self.signature.inputs)

    def initial_state(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self.initial_values.items()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model atomically (no partial file is left if writing fails)."""
        return save_atomically(self.model, path)

    def save_state(self, path: str | os.PathLike) -> Path:
        """Write ``initial_state()`` as an ``.npz`` file (what the CLI's ``--state`` writes)."""
        path = Path(path)
        np.savez(path, **self.initial_values)
        return path

    def session(self, providers=None) -> TrainingSession:
        """An onnxruntime session holding the initial state, ready for ``.step(inputs, target)``."""
        return TrainingSession(self.model, self.initial_state(), providers)


def save_atomically(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".onnx.tmp")
    os.close(handle)
    try:
        onnx.save(model, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
