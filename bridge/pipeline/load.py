"""Stage 1, load: read an ONNX model, validate it and clean it up for import.

Clean-up steps (each a small pure function on a ModelProto):
- inline model-local functions, so the importer sees only standard ops;
- pin the inputs given values (``constant_inputs=``) and inline each ``If`` that a pin decides
  (``inline_decided_ifs``), so the weights inside its taken branch are top-level values;
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
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.defs
import onnx.inliner
from onnx import numpy_helper

from ..contract import BATCH_NORM
from ..errors import BridgeWarning, InvalidOptionError, ModelLoadError, ShapeError, UnsupportedOpError
from ..onnx_file import all_nodes, check_onnx, fresh_name, read_model

MIN_OPSET = 7
MAX_OPSET = onnx.defs.onnx_opset_version()  # every opset the installed onnx defines
BATCH_NORM_MODES = ("train", "frozen")  # to_training_onnx(batch_norm=): batch statistics, or fixed running ones


def check_batch_norm(batch_norm: str | None) -> None:
    """``InvalidOptionError`` for a ``batch_norm=`` that is neither None nor a BatchNorm mode."""
    if batch_norm is not None and batch_norm not in BATCH_NORM_MODES:
        raise InvalidOptionError(f"batch_norm={batch_norm!r} is not a BatchNorm mode; choose one of "
                                 f"{list(BATCH_NORM_MODES)}")


def batch_norm_mode(model: onnx.ModelProto, asked: str | None) -> str:
    """The BatchNorm mode a conversion trains ``model`` in: ``asked``, else the file's mark (``BATCH_NORM``,
    written by ``export_for_training`` for a module whose BatchNorms were in ``eval()``), else ``train``."""
    if asked is not None:
        return asked
    return "frozen" if any(p.key == BATCH_NORM and p.value == "frozen" for p in model.metadata_props) else "train"


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
    return load_pinned(source, buffer_inputs)[0]


def load_pinned(source: str | os.PathLike | onnx.ModelProto,
                buffer_inputs: Mapping[str, Sequence[int]] | None = None,
                constant_inputs: Mapping[str, Any] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``load_model`` with the graph inputs ``constant_inputs`` names pinned to their values (checked by
    ``check_constant_inputs``; ``pin_inputs``) and the ``If`` nodes they decide inlined before Constant
    weights are promoted, so a model that keeps its weights as Constants inside such a branch trains them.
    Returns the model and the pins as arrays."""
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
    _import_default_domain(model)
    opset = default_opset(model)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ModelLoadError(
            f"{where} uses default-domain opset {opset}; bridge accepts {MIN_OPSET}..{MAX_OPSET}"
        )
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    if opset > KNOWN_OPSET:
        _check_newer_ops(model, opset, where)
    pins = check_constant_inputs(model, constant_inputs)
    if pins:
        pin_inputs(model, pins)
        inline_decided_ifs(model)
    fold_initializer_identities(model, buffer_inputs or {})
    name_unnamed_nodes(model)
    promoted = promote_constant_weights(model, pinned=pins)
    if promoted:
        warnings.warn(f"{where} stores its weights as Constant nodes; these {len(promoted)} float Constant "
                      f"output(s) are trained as weights under their output names: {', '.join(promoted)} "
                      "(frozen= keeps any of them constant)", PromotedConstantsWarning, stacklevel=3)
    return model, pins


def check_constant_inputs(model: onnx.ModelProto, given: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """``constant_inputs=`` checked against the graph's data inputs: each value as an array of the input's
    declared dtype and shape (a Python number or a flat list is cast where that is exact)."""
    if not given:
        return {}
    initializers = {init.name for init in model.graph.initializer}
    declared = {v.name: v for v in model.graph.input if v.name not in initializers}
    pins = {}
    for name, value in given.items():
        if name not in declared:
            raise InvalidOptionError(f"constant_inputs names '{name}', which is not a data input of the model; "
                                     f"its inputs are {list(declared)}")
        tensor_type = declared[name].type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        try:
            array = np.asarray(value)
            cast = array.astype(dtype)
        except (TypeError, ValueError) as exc:
            raise InvalidOptionError(f"constant_inputs['{name}'] = {value!r} is not a {dtype} value ({exc}); give "
                                     f"a number or a list of numbers") from exc
        exact = np.issubdtype(dtype, np.floating) and array.dtype.kind in "biuf"
        if not exact and not (array.dtype.kind in "biuf" and np.array_equal(cast, array)):
            raise InvalidOptionError(f"constant_inputs['{name}'] = {value!r} is not a value of input '{name}'s "
                                     f"type {dtype}; give a {dtype} value")
        if tensor_type.HasField("shape"):
            dims = tensor_type.shape.dim
            static = all(d.HasField("dim_value") for d in dims)
            wanted = [d.dim_value if d.HasField("dim_value") else None for d in dims]
            fixed = [d.dim_value for d in dims]
            if static and cast.shape != tuple(fixed) and cast.ndim <= 1 and cast.size == int(np.prod(fixed)):
                cast = cast.reshape(fixed)  # a flat list (the CLI's form) for a fixed shape
            if len(wanted) != cast.ndim or any(w is not None and w != s for w, s in zip(wanted, cast.shape,
                                                                                          strict=True)):
                shown = [w if w is not None else d.dim_param or "?" for w, d in zip(wanted, dims, strict=True)]
                raise ShapeError(f"constant_inputs['{name}'] has shape {list(cast.shape)}, but input '{name}' "
                                 f"has shape {shown}; give a value of that shape")
        pins[name] = np.ascontiguousarray(cast)
    return pins


def pin_inputs(model: onnx.ModelProto, pins: Mapping[str, np.ndarray]) -> None:
    """Replace the graph inputs ``pins`` names by ``Constant`` nodes of their values (in place)."""
    if not pins:
        return
    kept = [v for v in model.graph.input if v.name not in pins]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    constants = [onnx.helper.make_node("Constant", [], [name], name=f"{name}.pinned",
                                       value=numpy_helper.from_array(value, name))
                 for name, value in pins.items()]
    nodes = constants + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def inline_decided_ifs(model: onnx.ModelProto) -> None:
    """Replace each top-level ``If`` whose condition is known before the model runs (computed from pinned
    inputs and constants, folded by the importer: ``known_value``) by the nodes of the branch it takes, in
    place; a branch's outputs become ``Identity`` copies under the If's output names. Repeated until no such
    If is left, so an If nested in a taken branch and decided by the same pins is inlined too."""
    from .importer.program import known_value  # noqa: PLC0415 - the importer imports this module

    graph = model.graph
    while True:
        decided = next(((index, node, condition) for index, node in enumerate(graph.node)
                        if node.op_type == "If" and node.domain in ("", "ai.onnx")
                        and (condition := known_value(model, node.input[0])) is not None), None)
        if decided is None:
            return
        index, node, condition = decided
        taken = "then_branch" if bool(np.asarray(condition).reshape(-1)[0]) else "else_branch"
        branch = next(a.g for a in node.attribute if a.name == taken)
        copies = [onnx.helper.make_node("Identity", [value.name], [name], name=f"{node.name or name}.{taken}")
                  for value, name in zip(branch.output, node.output, strict=True) if name]
        graph.initializer.extend(branch.initializer)
        graph.sparse_initializer.extend(branch.sparse_initializer)
        nodes = [*graph.node[:index], *branch.node, *copies, *graph.node[index + 1:]]
        del graph.node[:]
        graph.node.extend(nodes)


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


def promote_constant_weights(model: onnx.ModelProto, pinned: Collection[str] = ()) -> list[str]:
    """Make the float ``Constant`` tensors (and ``ConstantOfShape`` fills of an initializer shape) of a model
    that has no float initializer of more than one element initializers (in place); their output names,
    which the weights keep. The Constants of ``pinned`` inputs (``pin_inputs``) stay values.

    Such a model stores its weights as Constants (paddle2onnx); a model with initializer weights keeps its
    Constants constant (masks, tables, anchors). Only tensors of more than one element are promoted: an
    exporter's epsilons, exponents and scales are single numbers. Whether a promoted tensor trains is decided
    as for any initializer: it must reach the loss differentiably (a Resize scale, a shape stays constant)."""
    graph = model.graph
    if any(_is_float(init.data_type) and _size(init.dims) > 1 for init in graph.initializer):
        return []
    outputs = {o.name for o in graph.output} | set(pinned)
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


ML_OPS_HINT = ("of ai.onnx.ml (classical ML), bridge imports LinearClassifier, Normalizer and ZipMap; the others "
               "(LinearRegressor, trees, SVMs, encoders) have no converter: export the model's math as standard "
               "ONNX ops (MatMul, Add, Softmax) to train it")


def _import_default_domain(model: onnx.ModelProto) -> None:
    """Give a model that imports no default-domain opset (onnxmltools' linear models use only ai.onnx.ml)
    the oldest opset bridge reads, so the importer can name or convert its ops (in place)."""
    if not any(entry.domain in ("", "ai.onnx") for entry in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("", MIN_OPSET))


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
