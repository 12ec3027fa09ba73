"""Stage 1, load: read an ONNX model, validate it and clean it up for import.

Clean-up steps (each a small pure function on a ModelProto):
- inline model-local functions, so the importer sees only standard ops;
- fold ``Identity`` nodes whose input is an initializer (legacy exporters de-duplicate
  equal tensors that way), so the consumer sees the initializer itself and the weight
  keeps one name and one gradient;
- name unnamed nodes ``<OpType>_<index>``, so every traced op can name its source node.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx.inliner

from .errors import ModelLoadError

MIN_OPSET = 7
MAX_OPSET = 22


def load_model(source: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """Read ``source`` (a path or a ModelProto), check it, and return a cleaned-up copy."""
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        where = "the given ModelProto"
    else:
        path = Path(source)
        where = f"'{path}'"
        if not path.is_file():
            raise ModelLoadError(f"model file {where} does not exist")
        try:
            model = onnx.load(str(path), load_external_data=True)
        except Exception as exc:  # protobuf raises several unrelated types
            raise ModelLoadError(f"{where} is not an ONNX model: {exc}") from exc
        if not model.graph.node and not model.graph.input:
            raise ModelLoadError(f"{where} is not an ONNX model: it has an empty graph")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelLoadError(f"{where} fails the ONNX checker: {exc}") from exc
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelLoadError(
            f"{where} uses default-domain opset {opset}; bridge accepts {MIN_OPSET}..{MAX_OPSET}"
        )
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    fold_initializer_identities(model)
    name_unnamed_nodes(model)
    return model


def default_opset(model: onnx.ModelProto) -> int:
    """The opset version of the default ONNX domain that ``model`` imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelLoadError("the model imports no default-domain opset")


def fold_initializer_identities(model: onnx.ModelProto) -> None:
    """Make consumers of ``Identity(initializer)`` read the initializer directly (in place).

    An Identity that feeds a running statistic (a converter's ``buffers=`` input) becomes a
    copy of the initializer under its own name instead: a buffer is updated, so it must not
    stay shared with a weight or another buffer that happened to hold equal values.
    """
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    graph_outputs = {out.name for out in graph.output}
    buffers = _buffer_inputs(graph)
    alias: dict[str, str] = {}
    kept = []
    for node in graph.node:
        source = alias.get(node.input[0], node.input[0]) if node.input else None
        if node.op_type == "Identity" and source in initializers and node.output[0] not in graph_outputs:
            if node.output[0] in buffers:
                copy = graph.initializer.add()
                copy.CopyFrom(initializers[source])
                copy.name = node.output[0]
            else:
                alias[node.output[0]] = source
            continue
        kept.append(node)
    if len(kept) == len(graph.node):
        return
    for node in kept:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
    del graph.node[:]
    graph.node.extend(kept)


def _buffer_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names read by nodes at their converters' running-statistic (``buffers=``) inputs."""
    from .importer.registry import CONVERTERS, import_all_converters

    import_all_converters()
    return {
        node.input[i]
        for node in graph.node
        if node.op_type in CONVERTERS
        for i in CONVERTERS[node.op_type].buffers
        if i < len(node.input)
    }


def name_unnamed_nodes(model: onnx.ModelProto) -> None:
    """Give each unnamed top-level node the unique name ``<OpType>_<index>`` (in place)."""
    taken = {node.name for node in model.graph.node}
    for index, node in enumerate(model.graph.node):
        if node.name:
            continue
        name, k = f"{node.op_type}_{index}", 0
        while name in taken:
            k += 1
            name = f"{node.op_type}_{index}_{k}"
        node.name = name
        taken.add(name)
