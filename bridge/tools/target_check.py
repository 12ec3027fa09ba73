"""``bridge.check(model, target="onnx-mlir")``: what in a graph the target compiler rejects.

Facts come from ``bridge/data/onnx_mlir_cpu_ops.json`` (onnx-mlir's CPU op table: supported
ops, their opset range and the limitation text). Beyond op and opset, every limitation that
can be decided from the graph alone has a rule here (``@rule("OpType")``): attributes,
outputs requested, inputs that must be constant, element types. When the table finds nothing and
onnx-mlir is installed (``ONNX_MLIR_HOME`` or ``PATH``), the graph is compiled too (``bridge.compile``,
``--EmitLib -O3``) and each compiler error becomes a violation of the node it names; ``compile=False``
skips that (large graphs take minutes).

``target="iree"``: the graph patterns IREE 3.13 (torch-mlir's ONNX import) rejects
(``@rule(..., target="iree")``, docs/onnx-mlir.md), then, when IREE is installed, an
actual compile whose errors become violations of the nodes they name.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..attributes import attribute
from ..errors import InvalidOptionError
from ..geometry import pooled_size
from ..onnx_file import all_nodes, read_model

if TYPE_CHECKING:
    from .compile import Progress

TARGETS = ("onnx-mlir", "iree")
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.DOUBLE}
SHORT_INTS = {TensorProto.INT8, TensorProto.INT16, TensorProto.UINT8, TensorProto.UINT16}
# element types onnx-mlir casts between as onnxruntime does (not bfloat16: its model library fails to load),
# except from bool, or a signed integer, to an unsigned integer of another width (fails to compile)
SIGNED_INTS = {TensorProto.BOOL, TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64}
UNSIGNED_INTS = {TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}
CAST_TYPES = SIGNED_INTS | UNSIGNED_INTS | {TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE}


@dataclass(frozen=True)
class Violation:
    """One thing the target rejects: the node, its op, what is wrong, and the table's text."""

    node: str
    op: str
    problem: str
    limitation: str = ""

    def __str__(self) -> str:
        text = f"{self.node or '<model>'} ({self.op}): {self.problem}"
        return f"{text} [onnx-mlir: {self.limitation}]" if self.limitation else text


@lru_cache(maxsize=1)
def op_table() -> dict:
    """onnx-mlir's CPU op table (``bridge/data/onnx_mlir_cpu_ops.json``)."""
    return json.loads(resources.files("bridge").joinpath("data/onnx_mlir_cpu_ops.json").read_text())


class _Graph:
    """What rules may ask about a graph: constant values and element types."""

    def __init__(self, model: onnx.ModelProto):
        inferred = onnx.shape_inference.infer_shapes(model)
        graph = inferred.graph
        self.constants = {init.name: init for init in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.constants[node.output[0]] = value
        self.types = {init.name: init.data_type for init in graph.initializer}
        self.shapes = {init.name: list(init.dims) for init in graph.initializer}
        for value in list(graph.input) + list(graph.output) + list(graph.value_info):
            if value.type.HasField("tensor_type"):
                self.types[value.name] = value.type.tensor_type.elem_type
                if value.type.tensor_type.HasField("shape"):
                    self.shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None
                                               for d in value.type.tensor_type.shape.dim]

    def constant(self, name: str) -> np.ndarray | None:
        tensor = self.constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)


Rule = Callable[[onnx.NodeProto, _Graph], Iterator[str]]
RULES: dict[str, dict[str, list[Rule]]] = {target: {} for target in TARGETS}


def rule(*op_types: str, target: str = "onnx-mlir"):
    """Register a check of nodes of ``op_types`` for ``target``: yields the problem of each violation."""

    def register(fn: Rule) -> Rule:
        for op in op_types:
            RULES[target].setdefault(op, []).append(fn)
        return fn

    return register


def _present(node: onnx.NodeProto, index: int, outputs: bool = False) -> bool:
    names = node.output if outputs else node.input
    return len(names) > index and names[index] != ""


@rule("MaxPool")
def _maxpool_indices(node, graph):
    if _present(node, 1, outputs=True):
        yield "the Indices output is requested (single output only)"


@rule("Reshape")
def _reshape_allowzero(node, graph):
    if attribute(node, "allowzero", 0):
        yield "allowzero=1"


REDUCTIONS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
              "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")


@rule(*REDUCTIONS)
def _reduce_keepdims(node, graph):
    if attribute(node, "keepdims", 1) == 0:
        yield "keepdims=0"


@rule("ReduceSum", "ReduceSumSquare")
def _reduce_default_axes(node, graph):
    if attribute(node, "axes") is None and not _present(node, 1):
        yield "no axes (reduce over the default axes)"


@rule("ConvTranspose")
def _convtranspose(node, graph):
    if graph.constant(node.input[1]) is None:
        yield f"weight W '{node.input[1]}' is not a constant"
    if attribute(node, "output_shape") is not None:
        yield "output_shape attribute (also fails to compile in IREE)"
    pads = attribute(node, "pads")
    if pads is not None and list(pads[: len(pads) // 2]) != list(pads[len(pads) // 2:]):
        yield f"asymmetric pads {list(pads)} (fail to compile in IREE)"


@rule("GRU", "LSTM", "RNN")
def _recurrent_constants(node, graph):
    for index, what in ((1, "W"), (2, "R"), (3, "B")):
        if _present(node, index) and graph.constant(node.input[index]) is None:
            yield f"{what} '{node.input[index]}' is not a constant"


@rule("Resize")
def _resize(node, graph):
    mode = attribute(node, "mode", "nearest")
    if mode in ("linear", "cubic"):
        yield f"mode={mode}"
    transform = attribute(node, "coordinate_transformation_mode", "half_pixel")
    if transform in ("tf_crop_and_resize", "pytorch_half_pixel"):
        yield f"coordinate_transformation_mode={transform}"
    if mode == "nearest" and attribute(node, "nearest_mode", "round_prefer_floor") == "floor":
        yield "nearest_mode=floor"
    for name in ("antialias", "axes", "keep_aspect_ratio_policy"):
        if attribute(node, name) is not None:
            yield f"attribute {name}"


@rule("Cast", "CastLike")
def _cast_types(node, graph):
    """The table allows float <-> double only; onnx-mlir compiles more (``CAST_TYPES``) and equals
    onnxruntime there (tests/test_onnx_mlir.py)."""
    source = graph.types.get(node.input[0])
    to = attribute(node, "to") if node.op_type == "Cast" else graph.types.get(node.input[1])
    for what, elem in (("from", source), ("to", to)):
        if elem is not None and elem not in CAST_TYPES:
            yield f"cast {what} {TensorProto.DataType.Name(elem)}"
    if source in SIGNED_INTS and to in UNSIGNED_INTS and (source == TensorProto.BOOL or _width(source) != _width(to)):
        yield f"cast from {TensorProto.DataType.Name(source)} to {TensorProto.DataType.Name(to)} (onnx-mlir fails to compile it)"


def _width(elem: int) -> int:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem)).itemsize


@rule("Dropout")
def _dropout_training(node, graph):
    if _present(node, 1, outputs=True):
        yield "the mask output is requested"
    if _present(node, 2):
        mode = graph.constant(node.input[2])
        if mode is None or bool(mode):
            yield "training mode"


@rule("BatchNormalization")
def _batchnorm_training(node, graph):
    if attribute(node, "training_mode", 0) or any(_present(node, i, outputs=True) for i in (1, 2)):
        yield "training mode (batch statistics / running statistics outputs)"


@rule("ScatterElements", "ScatterND")
def _scatter(node, graph):
    reduction = attribute(node, "reduction", "none")
    if reduction != "none":
        yield f"reduction={reduction}"
    indices = graph.constant(node.input[1])
    if node.op_type == "ScatterElements" and indices is not None:
        axis = attribute(node, "axis", 0) % indices.ndim
        lines = np.moveaxis(indices, axis, -1).reshape(-1, indices.shape[axis])
        if any(len(set(line.tolist())) < len(line) for line in lines):
            yield "duplicate indices"


@rule("LogSoftmax")
def _logsoftmax_axis(node, graph):
    axis = attribute(node, "axis")
    if axis is None or axis in (0, 1):
        yield f"axis {'default' if axis is None else axis}"


@rule("Pad")
def _pad_axes(node, graph):
    if _present(node, 3):
        yield "the axes input"


@rule("Shape")
def _shape_slice(node, graph):
    if attribute(node, "start") is not None or attribute(node, "end") is not None:
        yield "start/end attributes"


@rule("Slice")
def _slice_axes(node, graph):
    if _present(node, 3) and graph.constant(node.input[3]) is None:
        yield f"axes '{node.input[3]}' is not a constant"


@rule("Conv", target="iree")
def _conv_unread_padded_end(node, graph):
    """A strided Conv with a 1-wide output whose padded input has an end no window reads
    (docs/onnx-mlir.md; bridge's emitter pads exactly the read extent)."""
    shape = graph.shapes.get(node.input[0])
    if not shape or any(size is None for size in shape[2:]) or attribute(node, "auto_pad", "NOTSET") != "NOTSET":
        return
    kernel = attribute(node, "kernel_shape") or (graph.shapes.get(node.input[1]) or [None, None])[2:]
    rank = len(shape) - 2
    if len(kernel) != rank or None in kernel:
        return
    strides, dilations = attribute(node, "strides", [1] * rank), attribute(node, "dilations", [1] * rank)
    pads = attribute(node, "pads", [0] * 2 * rank)
    for axis, (size, k, s, d) in enumerate(zip(shape[2:], kernel, strides, dilations, strict=True)):
        padded = size + pads[axis] + pads[rank + axis]
        if pooled_size(padded, k, s, 0, d, False) == 1 and s > 1 and padded > d * (k - 1) + 1:
            yield (f"strided Conv with a 1-wide output whose padded input (axis {axis + 2}: {padded}) is longer "
                   f"than the window reads ({d * (k - 1) + 1}): pad or slice to the read extent")


@rule("Add", "Sub", "Mul", "Div", "Clip")
def _short_ints(node, graph):
    elem = graph.types.get(node.input[0])
    if elem in SHORT_INTS:
        yield f"short integer type {TensorProto.DataType.Name(elem)}"


def check(model: str | os.PathLike | onnx.ModelProto, target: str = "onnx-mlir", *, compile: bool = True,
          progress: Progress | None = None) -> list[Violation]:
    """Every node (and the opset) that ``target`` does not compile; empty when all is clean.

    ``target="onnx-mlir"`` checks onnx-mlir's op table, ``target="iree"`` IREE's known patterns; when
    those find nothing, ``compile`` is True and the compiler is installed (``onnx_mlir_missing``,
    ``iree_installed``), the model is compiled (``bridge.compile``): each compiler error is a violation
    of the node it names. ``progress``: the compile's phase lines (``bridge.compile``'s).
    """
    if target not in TARGETS:
        raise InvalidOptionError(f"unknown check target '{target}'; targets: {', '.join(TARGETS)}")
    model = read_model(model)
    violations = _check_iree(model) if target == "iree" else _check_table(model)
    if violations or not compile or not (iree_installed() if target == "iree" else onnx_mlir_missing() is None):
        return violations
    return _compile_errors(model, target, progress)


def _check_table(model: onnx.ModelProto) -> list[Violation]:
    """onnx-mlir's op table and the rules for its limitations."""
    table = op_table()
    violations = []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset > table["opset_ceiling"]:
        violations.append(Violation("", "opset", f"default-domain opset {opset}; onnx-mlir supports up to {table['opset_ceiling']}"))
    graph = _Graph(model)
    for node in all_nodes(model.graph):
        if node.domain not in ("", "ai.onnx"):
            violations.append(Violation(node.name, node.op_type, f"non-default domain '{node.domain}'"))
            continue
        entry = table["ops"].get(node.op_type)
        if entry is None or not entry["supported"]:
            violations.append(Violation(node.name, node.op_type, "op not supported by onnx-mlir"))
            continue
        limitation = entry.get("limitations", "")
        if opset is not None and not entry["min_opset"] <= opset <= entry["max_opset"]:
            violations.append(Violation(
                node.name, node.op_type,
                f"opset {opset} outside the supported range {entry['min_opset']}..{entry['max_opset']}", limitation,
            ))
        for check_node in RULES["onnx-mlir"].get(node.op_type, ()):
            violations.extend(Violation(node.name, node.op_type, problem, limitation) for problem in check_node(node, graph))
    return violations


def iree_installed() -> bool:
    """Whether ``bridge check --target iree`` can compile (the ``bridge[iree]`` extra)."""
    from ..errors import MissingExtraError
    from ..training.runtime_iree import require_iree

    try:
        require_iree()
    except MissingExtraError:
        return False
    return True


def onnx_mlir_missing() -> str | None:
    """Why ``bridge check --target onnx-mlir`` cannot compile (no onnx-mlir found: what to install), or None."""
    from ..training.runtime_onnx_mlir import OnnxMlirNotFoundError, find_onnx_mlir

    try:
        find_onnx_mlir()
    except OnnxMlirNotFoundError as exc:
        return str(exc)
    return None


def _check_iree(model: onnx.ModelProto) -> list[Violation]:
    """IREE's pattern rules."""
    graph = _Graph(model)
    return [
        Violation(node.name, node.op_type, problem)
        for node in all_nodes(model.graph) for check_node in RULES["iree"].get(node.op_type, ())
        for problem in check_node(node, graph)
    ]


def _compile_errors(model: onnx.ModelProto, backend: str, progress: Progress | None) -> list[Violation]:
    """The errors of compiling ``model`` with ``backend`` (``bridge.compile``), each a violation of the node it names."""
    from .compile import CompileError
    from .compile import compile as compile_model

    compiler = {"iree": "IREE", "onnx-mlir": "onnx-mlir"}[backend]
    try:
        compile_model(model, backend=backend, progress=progress)
    except CompileError as exc:
        return [Violation(name, op or "graph", f"{compiler}: {message}") for name, op, message in exc.diagnostics] or [
            Violation("", "graph", str(exc))]
    return []
