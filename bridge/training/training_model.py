"""The result of a conversion: the training ONNX model plus what is needed to start training."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..atomic import AtomicWriter, atomic_writer, check_output_path
from ..contract import StepSignature
from ..errors import BridgeError, InvalidOptionError
from ..lora import LoraPlan, lora_inference
from ..onnx_file import copy_field, data_bytes, raw_bytes, read_model, tensor_bytes
from .inference import with_trained_values
from .runtime import StepSession, TrainingSession

PARTS = ("eval", "gradient", "update")  # the graphs saved beside the training step
# bytes of tensor data past which a saved model keeps its tensors in an external-data file
EXTERNAL_DATA_THRESHOLD = 1 << 30
EXTERNAL_TENSOR_BYTES = 1024  # in a model saved with external data, initializers over this size are in the data file


@dataclass
class TrainingModel:
    """A training-step ONNX model (``.model``) and its initial state.

    ``initial_state()`` gives a value for every graph input that is not data or target:
    the original weights and buffers, optimizer state as torch.optim initialises it,
    ``step`` (0) and ``lr``. The eval graph (``.eval_model``) and the step's two halves for accumulation
    (``.gradient_model``, ``.update_model``) are exported when first asked for, then kept: each would
    hold its own copy of the frozen weights (the eval step is also traced then: a conversion traces once).
    """

    model: onnx.ModelProto
    signature: StepSignature
    initial_values: dict[str, np.ndarray] = field(repr=False)
    target_shape: tuple[int, ...] = ()
    target_dtype: np.dtype = np.dtype(np.int64)
    eval_signature: StepSignature | None = None
    source: onnx.ModelProto | None = field(default=None, repr=False)  # the inference model, as given
    source_path: Path | None = None  # or the file it is read from when needed
    # builds each of PARTS on request (``part``; built parts are kept); for ``save``, called with a dict that
    # receives the arrays of its big constants, written as data-less stubs (``GraphBuilder.write_initializers``)
    exporters: Mapping[str, Callable[..., onnx.ModelProto]] = field(default_factory=dict, repr=False)
    lora: LoraPlan | None = None  # the adapters trained, for a LoRA conversion (docs/lora.md)
    _parts: dict[str, onnx.ModelProto | None] = field(default_factory=dict, init=False, repr=False)

    def part(self, name: str) -> onnx.ModelProto | None:
        """The graph ``name`` of ``PARTS`` (exported on first request, then kept), or None if it has none."""
        if name not in self._parts:
            self._parts[name] = self.exporters[name]() if name in self.exporters else None
        return self._parts[name]

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: every part exported (the exporters are closures over traced graphs)."""
        state = dict(self.__dict__, exporters={})
        state["_parts"] = {name: self.part(name) for name in PARTS}
        return state

    @property
    def eval_model(self) -> onnx.ModelProto | None:
        """Forward + loss in inference mode (returns every model output)."""
        return self.part("eval")

    @property
    def gradient_model(self) -> onnx.ModelProto | None:
        """The step's first half (forward + loss + backward), for accumulation."""
        return self.part("gradient")

    @property
    def update_model(self) -> onnx.ModelProto | None:
        """The step's second half (clipping + optimizer update), for accumulation."""
        return self.part("update")

    @property
    def weights(self) -> list[str]:
        return list(self.signature.weights)

    @property
    def data_inputs(self) -> list[str]:
        return list(self.signature.inputs)

    def initial_state(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self.initial_values.items()}

    def save(self, path: str | os.PathLike, state_path: str | os.PathLike | None = None, *,
             write_state: bool = True) -> Path:
        """Write the model, and beside it the eval graph as ``<name>.eval.onnx``, the gradient and
        update graphs as ``<name>.gradient.onnx`` and ``<name>.update.onnx`` and the initial state as
        ``<name>.state.npz`` (or at ``state_path``; ``write_state=False``: no state), so that
        ``Trainer(path)`` trains it; all atomically: every file appears, or none (bridge.atomic). A graph whose
        tensors exceed ``EXTERNAL_DATA_THRESHOLD`` bytes keeps them in ``<file>.data`` beside it."""
        path = Path(path)
        if state_path is not None and not write_state:
            raise InvalidOptionError(f"save({path}): state_path={state_path} with write_state=False; give one of them")
        with atomic_writer() as writer:
            for part in PARTS:
                self._write_part(writer, part, part_path(path, part))
            if write_state:
                self._write_state(writer, state_file(path) if state_path is None else state_path)
            write_model(writer, self.model, path)
        return path

    def _write_part(self, writer: AtomicWriter, part: str, path: Path) -> None:
        """Write the graph ``part``; one not yet requested is exported for the write only, with its big
        constants (frozen weights) as the traced graph's arrays (no protobuf copy of them is made)."""
        if part in self._parts:
            graph, arrays = self._parts[part], {}
        else:
            arrays: dict[str, np.ndarray] = {}
            graph = self.exporters[part](arrays) if part in self.exporters else None
        if graph is not None:
            write_model(writer, graph, path, arrays)

    def inference_model(self, state: Mapping[str, np.ndarray], merge: bool = True) -> onnx.ModelProto:
        """The source inference model with the weights and buffers of ``state`` (e.g. a session's
        ``.state``) in its initializers; see ``bridge.training.inference.with_trained_values``. For a LoRA
        conversion the adapters are folded into the base weights (``merge``), or kept beside them as nodes."""
        source = self.source if self.source is not None or self.source_path is None else read_model(self.source_path)
        if source is None:
            raise BridgeError("this TrainingModel does not hold its source model (it was not made by to_training_onnx)")
        names = self.signature.weights + self.signature.buffers
        missing = [name for name in names if name not in state]
        if missing:
            raise BridgeError(f"the state lacks {missing}; pass a session's .state (or initial_state())")
        values = {name: np.asarray(state[name]) for name in names}
        if self.lora is not None:
            source = lora_inference(source, self.lora, values, merge)
        return with_trained_values(source, values)

    def export_inference(self, path: str | os.PathLike, state: Mapping[str, np.ndarray], merge: bool = True) -> Path:
        """Write the source inference model with the trained weights and running statistics of
        ``state`` (same inputs, outputs, ops and value names), atomically; ``merge``: see ``inference_model``."""
        return save_atomically(self.inference_model(state, merge), path)

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

    def session(self, providers=None, seed: int | None = None, on_nonfinite: str = "raise",
                threads: int | None = None, spinning: bool = True, gradients: bool = True,
                backend: str = "onnxruntime") -> StepSession:
        """An onnxruntime session holding the initial state, ready for ``.step(inputs, target)``
        and ``.evaluate(inputs, target)`` (the eval graph); ``threads`` / ``spinning``: its intra-op
        threads and whether they spin (``bridge.training.runtime.session_options``); ``gradients=False``: steps
        do not return ``grad_*`` (faster, ``TrainingSession``). ``backend="iree"`` or ``"onnx-mlir"``: the
        graph compiled by ``bridge.compile`` and stepped there (``providers``, ``threads``, ``spinning`` unused)."""
        if backend != "onnxruntime":
            from ..tools.compile import compile as compile_model

            return compile_model(self, backend=backend, gradients=gradients).session(
                seed=seed, eval_model=self.eval_model, on_nonfinite=on_nonfinite)
        return TrainingSession(self.model, self.initial_state(), providers, seed, eval_model=self.eval_model,
                               on_nonfinite=on_nonfinite, threads=threads, spinning=spinning, gradients=gradients)


def part_path(path: str | os.PathLike, part: str) -> Path:
    """Where ``TrainingModel.save(path)`` writes the graph ``part`` (eval, gradient, update):
    ``<name>.<part>.onnx``."""
    return Path(str(path).removesuffix(".onnx") + f".{part}.onnx")


def state_file(path: str | os.PathLike) -> Path:
    """Where ``TrainingModel.save(path)`` and ``bridge convert -o path`` write the initial state, and where
    ``Trainer(path)`` reads it: ``<name>.state.npz``."""
    return Path(str(path).removesuffix(".onnx") + ".state.npz")


def eval_path(path: str | os.PathLike) -> Path:
    """Where ``TrainingModel.save(path)`` writes the eval graph: ``<name>.eval.onnx``."""
    return part_path(path, "eval")


def save_atomically(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write ``model`` to ``path`` atomically (external data past ``EXTERNAL_DATA_THRESHOLD``)."""
    with atomic_writer() as writer:
        write_model(writer, model, path)
    return Path(path)


def write_model(writer: AtomicWriter, model: onnx.ModelProto, path: str | os.PathLike,
                arrays: Mapping[str, np.ndarray] | None = None) -> None:
    """Write ``model`` to a temporary of ``writer`` for ``path``; past ``EXTERNAL_DATA_THRESHOLD``
    bytes of tensors, with its tensors in ``<name>.data`` beside it (protobuf's 2 GiB limit). ``arrays``:
    the data of initializers that ``model`` holds as data-less stubs (an export for writing only).
    The in-memory ``model`` is left as it was."""
    path = Path(path)
    arrays = arrays or {}
    if tensor_bytes(model) <= EXTERNAL_DATA_THRESHOLD:  # stubs count with their arrays' sizes
        stream_model(model, writer.path(path), arrays)
        return
    folder = writer.folder(path)
    data = path.name + ".data"
    if stream_model(model, folder / path.name, arrays, folder / data):
        writer.add(folder / data, check_output_path(path.parent / data))
    writer.add(folder / path.name, path)


def stream_model(model: onnx.ModelProto, path: Path, arrays: Mapping[str, np.ndarray],
                 data_path: Path | None = None) -> bool:
    """Serialize ``model`` to ``path`` one initializer at a time (no serialized copy of all its tensors:
    protobuf would make two); with ``data_path``, initializers of over ``EXTERNAL_TENSOR_BYTES`` keep their
    bytes there (ONNX external data, ``location`` its file name, as ``onnx.save_model`` writes it). Without
    ``arrays`` and ``data_path``, the bytes are those of ``model.SerializeToString()``. Returns True when
    data was written to ``data_path``."""
    head, tail = _split_fields(model, _MODEL_GRAPH_FIELD)
    graph_head, graph_tail = _split_fields(model.graph, _GRAPH_INITIALIZER_FIELD)
    plan = _plan_tensors(model.graph.initializer, arrays, data_path)
    graph_size = len(graph_head) + len(graph_tail) + sum(_entry_size(size) for *_, size in plan)
    data_file = open(data_path, "xb") if data_path is not None else contextlib.nullcontext()
    with open(path, "xb") as file, data_file as data:
        file.write(head + _key(_MODEL_GRAPH_FIELD) + _varint(graph_size) + graph_head)
        for tensor, entry_head, entry_tail, size in plan:
            file.write(_key(_GRAPH_INITIALIZER_FIELD) + _varint(size))
            if entry_head is None:  # no raw data: the tensor as it is
                file.write(tensor.SerializeToString())
            elif entry_tail is None:  # a stub of external data
                file.write(entry_head)
                data.write(_raw_bytes(tensor, arrays))
            else:  # the raw data between the fields numbered before it and those after it
                raw = _raw_bytes(tensor, arrays)
                file.write(entry_head + _key(_RAW_DATA_FIELD) + _varint(len(raw)))
                file.write(raw)
                file.write(entry_tail)
        file.write(graph_tail + tail)
    external = any(entry_head is not None and entry_tail is None for _, entry_head, entry_tail, _ in plan)
    if data_path is not None and not external:
        data_path.unlink()
    return external


_MODEL_GRAPH_FIELD = 7  # ModelProto.graph
_GRAPH_INITIALIZER_FIELD = 5  # GraphProto.initializer


def _split_fields(message, number: int) -> tuple[bytes, bytes]:
    """``message`` serialized without field ``number``: the fields before it and those after it (protobuf
    writes fields in the order of their numbers, so head + field + tail is ``SerializeToString``)."""
    head, tail = type(message)(), type(message)()
    for descriptor, value in message.ListFields():
        if descriptor.number != number:
            copy_field(head if descriptor.number < number else tail, descriptor, value)
    return head.SerializeToString(), tail.SerializeToString()


def _key(number: int) -> bytes:
    return _varint(number << 3 | 2)  # a length-delimited field


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _entry_size(size: int) -> int:
    return len(_key(_GRAPH_INITIALIZER_FIELD)) + len(_varint(size)) + size


_RAW_DATA_FIELD = 9  # TensorProto.raw_data


def _plan_tensors(tensors, arrays: Mapping[str, np.ndarray], data_path: Path | None) -> list[tuple]:
    """For each initializer, how it is written without a copy of its data: (the tensor, the serialized
    fields before its raw data, those after it, the size of its serialized entry); the fields are
    (stub, None) for a tensor whose data goes to ``data_path`` (external data) and (None, None) for a
    tensor without raw data (written as it is)."""
    plan, offset = [], 0
    for tensor in tensors:
        if tensor.name not in arrays and not tensor.HasField("raw_data"):
            plan.append((tensor, None, None, tensor.ByteSize()))
            continue
        entry = _without_raw_data(tensor)
        length = arrays[tensor.name].nbytes if tensor.name in arrays else data_bytes(tensor)
        if data_path is not None and length > EXTERNAL_TENSOR_BYTES:
            entry.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(length))):
                entry.external_data.add(key=key, value=value)
            offset += length
            stub = entry.SerializeToString()
            plan.append((tensor, stub, None, len(stub)))
            continue
        before, after = _split_fields(entry, _RAW_DATA_FIELD)
        plan.append((tensor, before, after, len(before) + len(_key(_RAW_DATA_FIELD)) + len(_varint(length)) + length
                     + len(after)))
    return plan


def _without_raw_data(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """``tensor``'s fields but its raw data and data location (``CopyFrom`` would copy the data; protobuf
    cannot copy a tensor over 2 GiB at all)."""
    entry = onnx.TensorProto()
    for descriptor in tensor.DESCRIPTOR.fields:
        if descriptor.name in ("raw_data", "data_location", "external_data"):
            continue
        if descriptor.is_repeated:
            getattr(entry, descriptor.name).extend(getattr(tensor, descriptor.name))
        elif tensor.HasField(descriptor.name):
            copy_field(entry, descriptor, getattr(tensor, descriptor.name))
    return entry


def _raw_bytes(tensor: onnx.TensorProto, arrays: Mapping[str, np.ndarray]) -> bytes | None:
    """The raw data of ``tensor``: its array's bytes for a stub backed by ``arrays``."""
    if tensor.name in arrays:
        return raw_bytes(arrays[tensor.name])
    return tensor.raw_data if tensor.HasField("raw_data") else None
