"""The result of a conversion: the training ONNX model plus what is needed to start training."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx

from .errors import BridgeError
from .inference import with_trained_values
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
    eval_model: onnx.ModelProto | None = field(default=None, repr=False)  # forward + loss, inference mode
    eval_signature: StepSignature | None = None
    source: onnx.ModelProto | None = field(default=None, repr=False)  # the inference model, as given
    # the step in two halves (forward + loss + backward; clipping + optimizer update), for accumulation
    gradient_model: onnx.ModelProto | None = field(default=None, repr=False)
    update_model: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def weights(self) -> list[str]:
        return list(self.signature.weights)

    @property
    def data_inputs(self) -> list[str]:
        return list(self.signature.inputs)

    def initial_state(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self.initial_values.items()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the model atomically (no partial file is left if writing fails), and beside it the
        eval graph as ``<name>.eval.onnx``, the gradient and update graphs as ``<name>.gradient.onnx``
        and ``<name>.update.onnx``."""
        for part, graph in (("eval", self.eval_model), ("gradient", self.gradient_model),
                            ("update", self.update_model)):
            if graph is not None:
                save_atomically(graph, part_path(path, part))
        return save_atomically(self.model, path)

    def inference_model(self, state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The source inference model with the weights and buffers of ``state`` (e.g. a session's
        ``.state``) in its initializers; see ``bridge.inference.with_trained_values``."""
        if self.source is None:
            raise BridgeError("this TrainingModel does not hold its source model (it was not made by to_training_onnx)")
        names = self.signature.weights + self.signature.buffers
        missing = [name for name in names if name not in state]
        if missing:
            raise BridgeError(f"the state lacks {missing}; pass a session's .state (or initial_state())")
        return with_trained_values(self.source, {name: np.asarray(state[name]) for name in names})

    def export_inference(self, path: str | os.PathLike, state: Mapping[str, np.ndarray]) -> Path:
        """Write the source inference model with the trained weights and running statistics of
        ``state`` (same inputs, outputs, ops and value names), atomically."""
        return save_atomically(self.inference_model(state), path)

    def save_state(self, path: str | os.PathLike) -> Path:
        """Write ``initial_state()`` as an ``.npz`` file (what the CLI's ``--state`` writes)."""
        path = Path(path)
        np.savez(path, **self.initial_values)
        return path

    def session(self, providers=None, seed: int | None = None, on_nonfinite: str = "raise") -> TrainingSession:
        """An onnxruntime session holding the initial state, ready for ``.step(inputs, target)``
        and ``.evaluate(inputs, target)`` (the eval graph)."""
        return TrainingSession(self.model, self.initial_state(), providers, seed,
                               eval_model=self.eval_model, on_nonfinite=on_nonfinite)


def part_path(path: str | os.PathLike, part: str) -> Path:
    """Where ``TrainingModel.save(path)`` writes the graph ``part`` (eval, gradient, update):
    ``<name>.<part>.onnx``."""
    return Path(str(path).removesuffix(".onnx") + f".{part}.onnx")


def eval_path(path: str | os.PathLike) -> Path:
    """Where ``TrainingModel.save(path)`` writes the eval graph: ``<name>.eval.onnx``."""
    return part_path(path, "eval")


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
