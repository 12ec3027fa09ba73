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
from collections.abc import Mapping, Sequence
from pathlib import Path

import onnx
import onnx.inliner

from ..errors import ModelLoadError, UnsupportedOpError
from ..onnx_file import check_onnx, read_model

MIN_OPSET = 7
MAX_OPSET = 22
_UNSUPPORTED_TYPES = {onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
                      onnx.TensorProto.FLOAT8E4M3FNUZ: "float8e4m3fnuz", onnx.TensorProto.FLOAT8E5M2: "float8e5m2",
                      onnx.TensorProto.FLOAT8E5M2FNUZ: "float8e5m2fnuz", onnx.TensorProto.FLOAT4E2M1: "float4e2m1"}


def load_model(source: str | os.PathLike | onnx.ModelProto,
               buffer_inputs: Mapping[str, Sequence[int]] | None = None) -> onnx.ModelProto:
    """Read ``source`` (a path or a ModelProto), check it, and return a cleaned-up copy.

    ``buffer_inputs`` maps op types to the inputs that are running statistics (the importer's
    ``bridge.pipeline.importer.registry.buffer_inputs()``): an ``Identity(initializer)`` feeding one is copied,
    not folded (see ``fold_initializer_identities``). This module needs no torch."""
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        where = "the given ModelProto"
    else:
        path = Path(source)
        where = f"'{path}'"
        model = read_model(path)
    check_onnx(model, where, ModelLoadError)
    _check_element_types(model, where)
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelLoadError(
            f"{where} uses default-domain opset {opset}; bridge accepts {MIN_OPSET}..{MAX_OPSET}"
        )
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    fold_initializer_identities(model, buffer_inputs or {})
    name_unnamed_nodes(model)
    return model


def _check_element_types(model: onnx.ModelProto, where: str) -> None:
    """Refuse initializers and inputs of element types bridge cannot compute in (bfloat16, float8)."""
    found = [f"{t.name} ({_UNSUPPORTED_TYPES[t.data_type]})" for t in model.graph.initializer
             if t.data_type in _UNSUPPORTED_TYPES]
    found += [f"{v.name} ({_UNSUPPORTED_TYPES[v.type.tensor_type.elem_type]})" for v in model.graph.input
              if v.type.tensor_type.elem_type in _UNSUPPORTED_TYPES]
    if found:
        raise UnsupportedOpError(f"{where} holds tensors of element types bridge does not train in: "
                                 f"{', '.join(found)}; convert them to float32 (or float16) first")


def default_opset(model: onnx.ModelProto) -> int:
    """The opset version of the default ONNX domain that ``model`` imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelLoadError("the model imports no default-domain opset")


def fold_initializer_identities(model: onnx.ModelProto, buffer_inputs: Mapping[str, Sequence[int]]) -> None:
    """Make consumers of ``Identity(initializer)`` read the initializer directly (in place).

    An Identity that feeds a running statistic (an input listed in ``buffer_inputs[op_type]``, a
    converter's ``buffers=``) becomes a copy of the initializer under its own name instead: a
    buffer is updated, so it must not stay shared with a weight or another buffer that happened
    to hold equal values.
    """
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    graph_outputs = {out.name for out in graph.output}
    buffers = _buffer_inputs(graph, buffer_inputs)
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


def _buffer_inputs(graph: onnx.GraphProto, buffer_inputs: Mapping[str, Sequence[int]]) -> set[str]:
    """Names read by nodes at their running-statistic inputs (``buffer_inputs[op_type]``)."""
    return {
        node.input[i]
        for node in graph.node
        for i in buffer_inputs.get(node.op_type, ())
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
