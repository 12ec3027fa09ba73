"""Read and write ONNX files: bridge's one model reader, tensor sizes, external data, the checker, fresh names, the names a node reads.

Shared by every stage and reader (torch-free): ModelProtos over protobuf's 2 GiB go through files with
external data, and the checker and shape inference see big initializers as data-less stubs.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper

from .errors import ModelLoadError

# tensor bytes past which a ModelProto is handled through files with external data (protobuf cannot
# serialize a message over 2 GiB; the margin leaves room for the graph itself)
LARGE_MODEL_BYTES = (1 << 31) - (64 << 20)
DIGEST_BY_PARTS_BYTES = 64 << 20  # models with more tensor bytes are hashed part by part
STUB_FILE = "stub.data"
STUB_BYTES = 1 << 20  # the checker sees tensors over this size as data-less stubs (their data is not checked)
def read_model(source: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """The ModelProto of ``source``: a ModelProto (as is), anything with a ``.model`` ModelProto (a
    ``TrainingModel``), or the ONNX file at a path (its external data loaded); ``ModelLoadError``
    naming the file when it cannot be read. bridge's one model reader."""
    if isinstance(source, onnx.ModelProto):
        return source
    model = getattr(source, "model", None)
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        path = Path(source)
    except TypeError as exc:
        raise ModelLoadError(f"cannot read an ONNX model from {type(source).__name__} {source!r}") from exc
    if path.is_dir():
        raise ModelLoadError(f"'{path}' is a folder, not an ONNX model file; give the path of the .onnx file")
    if not path.is_file():
        raise ModelLoadError(f"model file '{path}' does not exist")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf and the external-data reader raise several unrelated types
        raise ModelLoadError(f"'{path}' is not an ONNX model: {type(exc).__name__}: {exc}") from exc
    if not model.graph.node and not model.graph.input:
        raise ModelLoadError(f"'{path}' is not an ONNX model: it has an empty graph")
    return model


def tensor_bytes(model: onnx.ModelProto) -> int:
    """Bytes of tensor data in ``model`` (initializers and constant attributes, subgraphs included; a
    tensor whose data is external counts with the size of that data)."""
    return sum(data_bytes(tensor) for tensor in external_data_helper._get_all_tensors(model))


def data_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes of ``tensor``'s data, from its type and dims (protobuf's ``ByteSize`` serializes the
    tensor: a transient copy of it); a string tensor's serialized size."""
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return tensor.ByteSize()
    return onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize * math.prod(tensor.dims)


def raw_bytes(array: np.ndarray) -> bytes:
    """``array``'s bytes as an ONNX tensor's ``raw_data`` holds them (C order, little-endian)."""
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()


def is_large(model: onnx.ModelProto) -> bool:
    """True when ``model`` is too big for one protobuf message (it must be saved with external data)."""
    return tensor_bytes(model) >= LARGE_MODEL_BYTES


def check_onnx(model: onnx.ModelProto, where: str, error: type[Exception], full_check: bool = False) -> None:
    """``onnx.checker`` on ``model``, also past protobuf's 2 GiB (through a file with external data);
    a failure raises ``error`` naming ``where``."""
    try:
        stubbed = skeleton(model)
        if stubbed is model:
            onnx.checker.check_model(model, full_check=full_check)
            return
        for tensor in model.graph.initializer:
            if data_bytes(tensor) > STUB_BYTES:
                _check_data_size(tensor)
        with tempfile.TemporaryDirectory(prefix="bridge-check-") as folder:  # the stubs' (empty) data file
            Path(folder, STUB_FILE).touch()
            onnx.save(stubbed, os.path.join(folder, "model.onnx"))
            onnx.checker.check_model(os.path.join(folder, "model.onnx"), full_check=full_check)
    except Exception as exc:  # the checker raises ValidationError, protobuf errors, shape inference errors
        raise error(f"{where} fails the ONNX checker: {exc}") from exc


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each initializer over ``STUB_BYTES`` replaced by an external-data stub of the same
    name, type and dims: what the checker and shape inference need, without serializing the weights
    (copies of them dominated the memory of loading and exporting a big model; past 2 GiB, protobuf
    cannot serialize them at all)."""
    big = [t for t in model.graph.initializer
           if data_bytes(t) > STUB_BYTES or t.data_location == onnx.TensorProto.EXTERNAL]
    if not big:
        return model
    skeleton = onnx.ModelProto()
    for descriptor, value in model.ListFields():
        if descriptor.name != "graph":
            copy_field(skeleton, descriptor, value)
    for descriptor, value in model.graph.ListFields():
        if descriptor.name != "initializer":
            copy_field(skeleton.graph, descriptor, value)
    names = {t.name for t in big}
    for tensor in model.graph.initializer:
        if tensor.name not in names:
            skeleton.graph.initializer.append(tensor)
            continue
        stub = skeleton.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.external_data.add(key="location", value=STUB_FILE)
    return skeleton


def rename_values(nodes: Iterable[onnx.NodeProto], rename: Mapping[str, str]) -> None:
    """Rename the inputs and outputs of ``nodes`` in place by ``rename`` (a name not in it stays)."""
    for node in nodes:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)


def inferred_values(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """ONNX shape inference's value_info of ``model``'s intermediate values, run on its ``skeleton``
    (no copy of the weights)."""
    return list(onnx.shape_inference.infer_shapes(skeleton(model)).graph.value_info)


def _check_data_size(tensor: onnx.TensorProto) -> None:
    """What the checker verifies of a tensor that it sees as a stub (``skeleton``): its raw data fits its
    type and dims."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
        return
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    need, got = itemsize * math.prod(tensor.dims), len(tensor.raw_data)
    if got != need:
        raise ValueError(f"initializer '{tensor.name}' holds {got} bytes; its type and dims {list(tensor.dims)} need {need}")


def copy_field(target, descriptor, value) -> None:
    """Set field ``descriptor`` of message ``target`` to ``value`` (a ``ListFields`` entry of another)."""
    if hasattr(value, "extend"):  # a repeated field
        getattr(target, descriptor.name).extend(value)
    elif hasattr(value, "CopyFrom"):  # a message
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)


def save_external(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Save ``model`` at ``path`` with its tensors in ``<name>.data`` beside it; the in-memory model
    keeps its tensors (they are read back)."""
    path = Path(path)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    external_data_helper.load_external_data_for_model(model, str(path.parent))


@contextlib.contextmanager
def external_copy(model: onnx.ModelProto) -> Iterator[str]:
    """The path of a temporary copy of ``model`` with external data (for tools that take a path)."""
    with tempfile.TemporaryDirectory(prefix="bridge-") as folder:
        path = os.path.join(folder, "model.onnx")
        save_external(model, path)
        yield path


def model_digest(model: onnx.ModelProto, by_parts: bool = False) -> str:
    """sha256 identifying ``model``: of its serialization, or for a model with over
    ``DIGEST_BY_PARTS_BYTES`` of tensors (any model with ``by_parts``), of its parts one at a time (nodes,
    values, tensors), so that no serialized copy of the whole model is made."""
    if not by_parts and tensor_bytes(model) < DIGEST_BY_PARTS_BYTES:
        return hashlib.sha256(model.SerializeToString()).hexdigest()
    digest = hashlib.sha256()
    graph = model.graph
    for part in [*model.opset_import, *graph.node, *graph.input, *graph.output, *model.metadata_props]:
        digest.update(part.SerializeToString())
    for tensor in graph.initializer:
        digest.update(f"{tensor.name}:{tensor.data_type}:{list(tensor.dims)}".encode())
        # a tensor without raw_data holds its values in a typed field (float_data, int64_data, ...)
        digest.update(tensor.raw_data if tensor.HasField("raw_data") else tensor.SerializeToString())
    return digest.hexdigest()


def fresh_name(hint: str, taken: set[str], separator: str = "_") -> str:
    """``hint``, or ``hint<separator><k>`` for the first ``k`` not in ``taken``; the name is added to ``taken``."""
    name, k = hint, 0
    while name in taken:
        k += 1
        name = f"{hint}{separator}{k}"
    taken.add(name)
    return name


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """``node``'s subgraphs: If branches, Loop and Scan bodies."""
    return [sub for attribute in node.attribute
            for sub in [*attribute.graphs, *([attribute.g] if attribute.HasField("g") else [])]]


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The nodes of ``graph`` and, recursively, of its subgraphs (If branches, Loop/Scan bodies)."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from all_nodes(sub)


def node_reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node`` reads: its inputs and, through its subgraphs (If/Loop/Scan bodies), outer values."""
    return set(node.input).union(*(graph_reads(sub) for sub in subgraphs(node)))


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs reads."""
    return {name for node in graph.node for name in node_reads(node)}


def subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every name read inside the subgraphs of ``graph``'s nodes (a body may read outer values by name)."""
    return {name for node in graph.node for sub in subgraphs(node) for name in graph_reads(sub)}
