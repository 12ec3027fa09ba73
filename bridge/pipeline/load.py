"""Stage 1, load: read an ONNX model, validate it and clean it up for import.

Clean-up steps (each a small pure function on a ModelProto):
- inline model-local functions, so the importer sees only standard ops;
- fold ``Identity`` nodes whose input is an initializer (legacy exporters de-duplicate
  equal tensors that way), so the consumer sees the initializer itself and the weight
  keeps one name and one gradient;
- name unnamed nodes ``<OpType>_<index>``, so every traced op can name its source node;
- promote float ``Constant`` tensors (and ``ConstantOfShape`` fills of a constant shape) to initializers
  in a model that stores its weights that way (paddle2onnx, onnx's weight-stripped test models), so they
  train like any initializer (``promote_constant_weights``).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.defs
import onnx.inliner
from onnx import numpy_helper

from ..errors import BridgeWarning, ModelLoadError, UnsupportedOpError
from ..onnx_file import all_nodes, check_onnx, fresh_name, read_model

MIN_OPSET = 7
MAX_OPSET = onnx.defs.onnx_opset_version()  # every opset the installed onnx defines
KNOWN_OPSET = 22  # the newest opset whose op semantics the importer knows
# ops whose versions after KNOWN_OPSET (up to 25) only add element types (float4, float8e8m0, int2/4):
# the importer's opset-22 form computes them
_TYPES_ONLY = {"Cast", "CastLike", "Constant", "ConstantOfShape", "Flatten", "Identity", "If", "Loop", "Pad",
               "Reshape", "Scan", "Shape", "Size", "Squeeze", "Transpose", "Unsqueeze"}
_TYPES_ONLY_UNTIL = 25


class PromotedConstantsWarning(BridgeWarning):
    """Float Constant tensors were made initializers (weights), as the model stores no weight otherwise."""

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
    _check_default_domain(model, where)
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelLoadError(
            f"{where} uses default-domain opset {opset}; bridge accepts {MIN_OPSET}..{MAX_OPSET}"
        )
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    if opset > KNOWN_OPSET:
        _check_newer_ops(model, opset, where)
    fold_initializer_identities(model, buffer_inputs or {})
    name_unnamed_nodes(model)
    promoted = promote_constant_weights(model)
    if promoted:
        warnings.warn(f"{where} stores its weights as Constant nodes; these {len(promoted)} float Constant "
                      f"output(s) are trained as weights under their output names: {', '.join(promoted)} "
                      "(frozen= keeps any of them constant)", PromotedConstantsWarning, stacklevel=3)
    return model


def _check_newer_ops(model: onnx.ModelProto, opset: int, where: str) -> None:
    """Refuse nodes whose op at ``opset`` is a version newer than ``KNOWN_OPSET`` that changes more than the
    element types (``_TYPES_ONLY``); every other node computes as at opset ``KNOWN_OPSET``."""
    newer: dict[str, list[str]] = {}
    for node in all_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            since = onnx.defs.get_schema(node.op_type, opset, "").since_version
        except onnx.defs.SchemaError:
            continue  # not a standard op: the importer names it
        if since > KNOWN_OPSET and not (node.op_type in _TYPES_ONLY and since <= _TYPES_ONLY_UNTIL):
            newer.setdefault(f"{node.op_type}-{since}", []).append(node.name or node.output[0])
    if newer:
        listing = "; ".join(f"{op} (nodes: {', '.join(names)})" for op, names in sorted(newer.items()))
        raise UnsupportedOpError(f"{where} uses default-domain opset {opset}, and these ops at versions newer than "
                                 f"{KNOWN_OPSET} that bridge does not compute yet: {listing}; export the model at "
                                 f"opset {KNOWN_OPSET} or lower")


def promote_constant_weights(model: onnx.ModelProto) -> list[str]:
    """Make the float ``Constant`` tensors (and ``ConstantOfShape`` fills of an initializer shape) of a model
    that has no float initializer of more than one element initializers (in place); their output names,
    which the weights keep.

    Such a model stores its weights as Constants (paddle2onnx); a model with initializer weights keeps its
    Constants constant (masks, tables, anchors). Only tensors of more than one element are promoted: an
    exporter's epsilons, exponents and scales are single numbers. Whether a promoted tensor trains is decided
    as for any initializer: it must reach the loss differentiably (a Resize scale, a shape stays constant)."""
    graph = model.graph
    if any(_is_float(init.data_type) and _size(init.dims) > 1 for init in graph.initializer):
        return []
    outputs = {o.name for o in graph.output}
    shapes = {init.name: init for init in graph.initializer if init.data_type == onnx.TensorProto.INT64}
    promoted, kept = [], []
    for node in graph.node:
        tensor = _constant_tensor(node, shapes)
        if tensor is not None and node.output[0] not in outputs:
            init = graph.initializer.add()
            init.CopyFrom(tensor)
            init.name = node.output[0]
            promoted.append(init.name)
        else:
            kept.append(node)
    if promoted:
        del graph.node[:]
        graph.node.extend(kept)
    return promoted


def _constant_tensor(node: onnx.NodeProto, shapes: Mapping[str, onnx.TensorProto]) -> onnx.TensorProto | None:
    """The float tensor of more than one element that a ``Constant`` node holds (``value`` or
    ``value_floats``) or that a ``ConstantOfShape`` of an initializer shape fills with its float
    ``value`` (weight-stripped test models), else None."""
    if node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    if node.op_type == "ConstantOfShape":
        return _filled_tensor(node, shapes)
    if node.op_type != "Constant":
        return None
    attribute = node.attribute[0]
    if attribute.name == "value" and _is_float(attribute.t.data_type) and _size(attribute.t.dims) > 1:
        return attribute.t
    if attribute.name == "value_floats" and len(attribute.floats) > 1:
        return numpy_helper.from_array(np.array(attribute.floats, dtype=np.float32))
    return None


def _filled_tensor(node: onnx.NodeProto, shapes: Mapping[str, onnx.TensorProto]) -> onnx.TensorProto | None:
    """The tensor a ``ConstantOfShape`` node makes when its shape is an int64 initializer, its ``value``
    a float and the tensor has more than one element, else None."""
    attribute = node.attribute[0]
    shape = shapes.get(node.input[0]) if node.input else None
    if shape is None or attribute.name != "value" or not _is_float(attribute.t.data_type):
        return None
    dims = [int(d) for d in numpy_helper.to_array(shape).reshape(-1)]
    if _size(dims) <= 1:
        return None
    value = numpy_helper.to_array(attribute.t).reshape(-1)
    return numpy_helper.from_array(np.full(dims, value[0], dtype=value.dtype))


def _is_float(data_type: int) -> bool:
    return data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


def _size(dims) -> int:
    size = 1
    for dim in dims:
        size *= dim
    return size


def _check_element_types(model: onnx.ModelProto, where: str) -> None:
    """Refuse initializers and inputs of element types bridge cannot compute in (bfloat16, float8)."""
    found = [f"{t.name} ({_UNSUPPORTED_TYPES[t.data_type]})" for t in model.graph.initializer
             if t.data_type in _UNSUPPORTED_TYPES]
    found += [f"{v.name} ({_UNSUPPORTED_TYPES[v.type.tensor_type.elem_type]})" for v in model.graph.input
              if v.type.tensor_type.elem_type in _UNSUPPORTED_TYPES]
    if found:
        raise UnsupportedOpError(f"{where} holds tensors of element types bridge does not train in: "
                                 f"{', '.join(found)}; convert them to float32 (or float16) first")


ML_OPS_HINT = ("ai.onnx.ml ops (classical ML: linear models, trees, ZipMap) keep their coefficients in attributes, "
               "not in tensors a training step can update; export the model's math as standard ONNX ops "
               "(MatMul, Add, Softmax) to train it")


def _check_default_domain(model: onnx.ModelProto, where: str) -> None:
    """Refuse a model that imports no default-domain opset by naming the ops it uses instead."""
    if any(entry.domain in ("", "ai.onnx") for entry in model.opset_import):
        return
    ops = sorted({f"{node.domain}::{node.op_type}" for node in model.graph.node})
    raise UnsupportedOpError(f"{where} uses no standard ONNX op, only {', '.join(ops)}, which bridge cannot import"
                             + (f"; {ML_OPS_HINT}" if any(op.startswith("ai.onnx.ml::") for op in ops) else ""))


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
        node.name = fresh_name(f"{node.op_type}_{index}", taken)
