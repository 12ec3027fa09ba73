"""After the export of a mixed-precision step: each float16/bfloat16 node that cannot run in that type computes
in float32 between Casts (its low-precision inputs widened, its outputs rounded back once).

A node cannot run in the low type when the ONNX schema does not allow it (bfloat16 Conv, for one: the
canonical graph needs this on every target), or, for the ``onnxruntime`` target, when onnxruntime's CPU has no
kernel for it (asked of onnxruntime itself, one single-node session per op and type signature). Not one of
``targets.FORMS``: those change a float32 graph's form, this one only exists in mixed precision. The element types are propagated through the graph with the
ONNX schemas' type constraints.
"""
from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from ..onnx_file import fresh_name
from .export import OPSET
from .targets import current

LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def widen_unsupported(model: onnx.ModelProto) -> None:
    """Rewrite ``model`` in place: the low-precision nodes without a low-precision form (schema, or the
    current target's runtime) compute in float32 between Casts."""
    graph = model.graph
    types = {value.name: value.type.tensor_type.elem_type for value in graph.input}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    runs: Callable[[onnx.NodeProto, dict[str, int]], bool] = _onnxruntime_runs if current() == "onnxruntime" \
        else lambda node, types: True
    taken = set(types) | {name for node in graph.node for name in [*node.output, node.name]}

    def fresh(base: str) -> str:
        return fresh_name(base, taken)

    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        bound = _bind(node, types)
        low = {var for var, elem in bound.items() if elem in LOW}
        widen = {var for var in low if not _schema_allows(node.op_type, var, bound[var])}
        if low and not widen and not runs(node, types):
            widen = low
        if not widen:
            _record_outputs(node, bound, types)
            nodes.append(node)
            continue
        nodes.extend(_widened(node, widen, bound, types, fresh))
    del graph.node[:]
    graph.node.extend(nodes)


def _schema(op_type: str) -> onnx.defs.OpSchema:
    return onnx.defs.get_schema(op_type, OPSET)


def _formal(params, index: int):
    """The formal parameter of actual input/output ``index`` (the last one repeats when variadic)."""
    return params[min(index, len(params) - 1)]


def _bind(node: onnx.NodeProto, types: dict[str, int]) -> dict[str, int]:
    """The element type each type variable of ``node``'s schema takes from its inputs."""
    schema = _schema(node.op_type)
    bound: dict[str, int] = {}
    for index, name in enumerate(node.input):
        if name and name in types:
            bound.setdefault(_formal(schema.inputs, index).type_str, types[name])
    return bound


def _schema_allows(op_type: str, var: str, elem: int) -> bool:
    constraints = {c.type_param_str: c.allowed_type_strs for c in _schema(op_type).type_constraints}
    type_string = f"tensor({TensorProto.DataType.Name(elem).lower()})"
    return var not in constraints or type_string in constraints[var]


def _record_outputs(node: onnx.NodeProto, bound: dict[str, int], types: dict[str, int]) -> None:
    """Record the element types of ``node``'s outputs: ``Cast``'s ``to``, a bound type variable, or the one
    type a constraint allows."""
    schema = _schema(node.op_type)
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    for index, name in enumerate(node.output):
        if not name:
            continue
        var = _formal(schema.outputs, index).type_str
        if node.op_type == "Cast":
            types[name] = next(a.i for a in node.attribute if a.name == "to")
        elif var in bound:
            types[name] = bound[var]
        elif len(constraints.get(var, [])) == 1 or var.startswith("tensor("):
            type_string = constraints[var][0] if var in constraints else var
            types[name] = _ELEM_OF[type_string]


_ELEM_OF = {f"tensor({TensorProto.DataType.Name(t).lower()})": t for t in TensorProto.DataType.values()}


def _widened(node: onnx.NodeProto, widen: set[str], bound: dict[str, int], types: dict[str, int],
             fresh: Callable[[str], str]) -> list[onnx.NodeProto]:
    """``node`` with its inputs of the type variables ``widen`` cast to float32 and those outputs cast back
    (``fresh``: an unused value name)."""
    schema = _schema(node.op_type)
    tags = list(node.metadata_props)
    casts: list[onnx.NodeProto] = []

    def cast(source: str, target: str, to: int) -> None:
        cast_node = helper.make_node("Cast", [source], [target], name=fresh(f"{node.name}/Cast"), to=to)
        cast_node.metadata_props.extend(tags)
        casts.append(cast_node)

    inputs = list(node.input)
    wide_names: dict[str, str] = {}
    for index, name in enumerate(inputs):
        if name and _formal(schema.inputs, index).type_str in widen:
            if name not in node.input[:index]:  # Mul(x, x): one Cast
                wide_names[name] = fresh(f"{name}.float32")
                cast(name, wide_names[name], TensorProto.FLOAT)
            inputs[index] = wide_names[name]
    wide = onnx.NodeProto()
    wide.CopyFrom(node)
    del wide.input[:]
    wide.input.extend(inputs)
    back: list[tuple[str, str, int]] = []
    for index, name in enumerate(node.output):
        var = _formal(schema.outputs, index).type_str
        if name and var in widen:
            wide.output[index] = fresh(f"{name}.float32")
            back.append((wide.output[index], name, bound[var]))
    _record_outputs(node, bound, types)
    nodes = [*casts, wide]
    casts.clear()
    for source, target, to in back:
        cast(source, target, to)
    return nodes + casts


def _onnxruntime_runs(node: onnx.NodeProto, types: dict[str, int]) -> bool:
    """Whether onnxruntime's CPU has a kernel for ``node`` with its inputs' element types."""
    attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
    signature = tuple(types.get(name, 0) if name else -1 for name in node.input)
    return _kernel_exists(node.op_type, signature, attributes, len(node.output))


@functools.cache
def _kernel_exists(op_type: str, signature: tuple[int, ...], attributes: tuple[tuple[str, bytes], ...],
                   outputs: int) -> bool:
    """One single-node onnxruntime session: creating it fails, or onnxruntime wraps the node in Casts, when
    no CPU kernel matches."""
    import onnxruntime

    names = [f"in{i}" if elem != -1 else "" for i, elem in enumerate(signature)]
    node = helper.make_node(op_type, names, [f"out{i}" for i in range(outputs)])
    for _, serialized in attributes:
        node.attribute.add().ParseFromString(serialized)
    inputs = [helper.make_tensor_value_info(name, elem, None) for name, elem in zip(names, signature, strict=True)
              if name]
    outs = [helper.make_empty_tensor_value_info(f"out{i}") for i in range(outputs)]
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outs),
                              opset_imports=[helper.make_opsetid("", OPSET)])
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    with tempfile.TemporaryDirectory() as folder:
        # a float16 node without a kernel is not refused: onnxruntime computes it in float32 between Casts it
        # inserts at every optimization level, and drops the rounding between two such nodes; the graph it
        # runs (written out) then holds more than the one node
        options.optimized_model_filepath = os.path.join(folder, "run.onnx")
        try:
            onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime's error classes are not importable by name everywhere
            return "NOT_IMPLEMENTED" not in str(exc) and "Could not find an implementation" not in str(exc)
        return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node] == [op_type]
