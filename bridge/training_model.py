"""The result of a conversion: the training ONNX model plus what is needed to start training."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx

from .atomic import AtomicWriter, atomic_writer, check_output_path
from .contract import StepSignature
from .errors import BridgeError
from .load import read_model, save_external, tensor_bytes
from .inference import with_trained_values
from .runtime import TrainingSession

# bytes of tensor data past which a saved model keeps its tensors in an external-data file
EXTERNAL_DATA_THRESHOLD = 1 << 30


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
    source_path: Path | None = None  # or the file it is read from when needed
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

    def save(self, path: str | os.PathLike, state_path: str | os.PathLike | None = None) -> Path:
        """Write the model, and beside it the eval graph as ``<name>.eval.onnx``, the gradient and
        update graphs as ``<name>.gradient.onnx`` and ``<name>.update.onnx`` (and with ``state_path``
        the initial state), all atomically: every file appears, or none (bridge.atomic). A graph whose
        tensors exceed ``EXTERNAL_DATA_THRESHOLD`` bytes keeps them in ``<file>.data`` beside it."""
        path = Path(path)
        with atomic_writer() as writer:
            for part, graph in (("eval", self.eval_model), ("gradient", self.gradient_model),
                                ("update", self.update_model)):
                if graph is not None:
                    write_model(writer, graph, part_path(path, part))
            if state_path is not None:
                self._write_state(writer, state_path)
            write_model(writer, self.model, path)
        return path

    def inference_model(self, state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
        """The source inference model with the weights and buffers of ``state`` (e.g. a session's
        ``.state``) in its initializers; see ``bridge.inference.with_trained_values``."""
        source = self.source if self.source is not None or self.source_path is None else read_model(self.source_path)
        if source is None:
            raise BridgeError("this TrainingModel does not hold its source model (it was not made by to_training_onnx)")
        names = self.signature.weights + self.signature.buffers
        missing = [name for name in names if name not in state]
        if missing:
            raise BridgeError(f"the state lacks {missing}; pass a session's .state (or initial_state())")
        return with_trained_values(source, {name: np.asarray(state[name]) for name in names})

    def export_inference(self, path: str | os.PathLike, state: Mapping[str, np.ndarray]) -> Path:
        """Write the source inference model with the trained weights and running statistics of
        ``state`` (same inputs, outputs, ops and value names), atomically."""
        return save_atomically(self.inference_model(state), path)

    def save_state(self, path: str | os.PathLike) -> Path:
        """Write ``initial_state()`` as an ``.npz`` file at exactly ``path`` (what the CLI's ``--state``
        writes), atomically. (npz is a zip64 archive: no size limit.)"""
        with atomic_writer() as writer:
            path = self._write_state(writer, path)
        return path

    def _write_state(self, writer: AtomicWriter, path: str | os.PathLike) -> Path:
        with open(writer.path(path, "state path"), "xb") as file:
            np.savez(file, **self.initial_values)
        return Path(path)

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
    """Write ``model`` to ``path`` atomically (external data past ``EXTERNAL_DATA_THRESHOLD``)."""
    with atomic_writer() as writer:
        write_model(writer, model, path)
    return Path(path)


def write_model(writer: AtomicWriter, model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write ``model`` to a temporary of ``writer`` for ``path``; past ``EXTERNAL_DATA_THRESHOLD``
    bytes of tensors, with its tensors in ``<name>.data`` beside it (protobuf's 2 GiB limit). The
    in-memory ``model`` is left as it was."""
    path = Path(path)
    if tensor_bytes(model) <= EXTERNAL_DATA_THRESHOLD:
        onnx.save(model, writer.path(path))
        return
    folder = writer.folder(path)
    data = path.name + ".data"
    save_external(model, folder / path.name)
    if (folder / data).exists():  # no tensor may be over save_external's size threshold
        writer.add(folder / data, check_output_path(path.parent / data))
    writer.add(folder / path.name, path)
