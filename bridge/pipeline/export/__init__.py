"""Stage 5, export: the joint FX graph -> one ONNX model of standard ops.

Walks the FX graph once; each ATen op is turned into ONNX nodes by its emitter
(``bridge.pipeline.export.ops``, one module per op family). Graph inputs and outputs are named by the
training contract (``StepSignature``), and every node carries the phase and layer that the
tracer attached to its FX node.
"""
from __future__ import annotations

import functools
import json
import operator
import re
from collections.abc import Mapping

import onnx
import sympy
import torch
import torch.fx
from onnx import helper

from ...contract import DIM_BOUNDS, DIM_NAMES, KIND, LAYER, OUTPUT_PREFIX, PHASE, UPDATED_PREFIX, Phase, StepSignature
from ...errors import LoweringError
from ...onnx_file import rename_values
from .builder import EMITTERS, TORCH_TO_ONNX, GraphBuilder, Value, import_all_emitters

OPSET = 18
IR_VERSION = 10


@functools.cache
def snake_case(name: str) -> str:
    """``BatchNormalization`` -> ``batch_normalization``; ``MatMul`` -> ``matmul``; ``<lambda>`` -> ``lambda``."""
    name = name.replace("MatMul", "Matmul")
    return re.sub(r"[^a-z0-9_]", "", re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower())


def _value_of(meta_val, name: str) -> Value:
    return Value(name, meta_val.shape, meta_val.dtype)


def _tags(node: torch.fx.Node) -> dict[str, str]:
    custom = node.meta.get("custom") or {}
    return {
        PHASE: custom.get("phase", ""),
        LAYER: custom.get("layer", ""),
        KIND: snake_case(custom.get("kind", "")),
    }


def export_step(graph_module: torch.fx.GraphModule, signature: StepSignature,
                constant_names: Mapping[tuple[int, tuple[int, ...]], str] | None = None,
                stubs: dict | None = None) -> onnx.ModelProto:
    """Translate the traced step into an ONNX ModelProto (named per the contract). ``constant_names``:
    initializer names by the data pointer and shape of their tensors, so that a constant the trace captured
    (a frozen weight) keeps its source name instead of ``_tensor_constant<N>``. ``stubs``: see
    ``GraphBuilder.write_initializers``."""
    import_all_emitters()
    b = GraphBuilder()
    env: dict[torch.fx.Node, object] = {}
    input_names = iter(signature.input_names())
    graph_inputs = []
    sizes: list[torch.SymInt] = []
    dim_names = graph_module.meta.get(DIM_NAMES, {})
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            name = next(input_names)
            b.reserve(name)
            env[node] = _value_of(node.meta["val"], name)
            graph_inputs.append(env[node])
            for axis, size in enumerate(env[node].shape):
                if isinstance(size, torch.SymInt):
                    b.add_symbol_source(size, env[node], axis)
                    sizes.append(size)
        elif node.op == "get_attr":
            tensor = getattr(graph_module, node.target)
            name = (constant_names or {}).get((tensor.data_ptr(), tuple(tensor.shape)), node.target)
            env[node] = b.const(tensor.detach().numpy(), name=name)
        elif node.op == "call_function":
            env[node] = _emit(b, node, env)
            if any(size.node.expr.is_number for size in sizes):
                raise LoweringError(
                    f"the ONNX emitter of {node.target} (FX node '{node.name}') turned a symbolic size "
                    "into a number (int() or == on a SymInt); it must build sizes with b.shape_tensor"
                )
        elif node.op == "output":
            outputs = node.args[0]
    graph_name = "bridge_eval_step" if not signature.training else f"bridge_{_GRAPH_NAMES[signature.part]}"
    model = _assemble(b, graph_inputs, [env[n] for n in outputs], signature.output_names(), graph_name, dim_names,
                      stubs)
    if graph_module.meta.get(DIM_BOUNDS):  # read by the runtime, which refuses larger sizes (docs/dynamic_batch.md)
        entry = model.metadata_props.add()
        entry.key, entry.value = DIM_BOUNDS, json.dumps(graph_module.meta[DIM_BOUNDS])
    return model


def _emit(b: GraphBuilder, node: torch.fx.Node, env: dict):
    """The ONNX value(s) of one FX node: its emitter's, run in the node's context (tags and value
    name hint, ``GraphBuilder.node_context``); a ``getitem`` picks from a multi-output result."""
    tags = _tags(node)
    if node.target is operator.getitem:
        return _with_meta(env[node.args[0]][node.args[1]], node)
    emitter = EMITTERS.get(node.target)
    if emitter is None and not isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat)) and node.target is not torch.sym_float:
        raise LoweringError(
            f"no ONNX lowering for ATen op {node.target} (FX node '{node.name}', phase "
            f"'{tags[PHASE]}', from ONNX node '{tags[LAYER]}')"
        )
    with b.node_context({k: v for k, v in tags.items() if v}, node.name):
        return _emit_in_context(b, node, emitter, env)


def _emit_in_context(b: GraphBuilder, node: torch.fx.Node, emitter, env: dict):
    """Size arithmetic (SymInt/SymFloat values) rebuilt from its expression; any other op by ``emitter``."""
    if isinstance(node.meta.get("val"), torch.SymInt):  # size arithmetic: rebuilt from its expression
        return b.dim(node.meta["val"])
    if node.target is torch.sym_float:
        return b.size_scalar(node.args[0].meta["val"], torch.float32)
    if isinstance(node.meta.get("val"), torch.SymFloat) and node.target in _FLOAT_SIZE_OPS:
        lhs, rhs = (b.operand(env[a] if isinstance(a, torch.fx.Node) else a, torch.float32) for a in node.args)
        return b.op(_FLOAT_SIZE_OPS[node.target], lhs, rhs, shape=[], dtype=torch.float32)
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    return _with_meta(emitter(b, node, *args, **kwargs), node)


def _with_meta(result, node: torch.fx.Node):
    """Give an emitted value the traced shape and dtype of its FX node."""
    val = node.meta.get("val")
    if isinstance(result, Value) and isinstance(val, torch.Tensor):
        result.shape, result.dtype = Value("", val.shape).shape, val.dtype
    return result


_GRAPH_NAMES = {"step": "training_step", "gradient": "gradient_step", "update": "update_step"}

# Python arithmetic on symbolic sizes that yields a float (e.g. 1 / numel in a mean's backward).
_FLOAT_SIZE_OPS = {operator.truediv: "Div", operator.mul: "Mul", operator.add: "Add", operator.sub: "Sub"}


def _dims(shape, dim_names: dict[sympy.Symbol, str]) -> list:
    """Static dims as ints; a symbolic dim as a dim_param: its name (``batch``, ``seq``), or for a
    size computed from named dims, that expression (``batch*seq``)."""
    names = {symbol: sympy.Symbol(name) for symbol, name in dim_names.items()}
    return [str(d.node.expr.xreplace(names)) if isinstance(d, torch.SymInt) else d for d in shape]


def _alias_phase(output: str) -> str:
    """The phase of an Identity that gives a graph output its name."""
    if output.startswith(UPDATED_PREFIX):
        return Phase.OPTIMIZER
    if output.startswith(OUTPUT_PREFIX):
        return Phase.FORWARD
    return Phase.BACKWARD


def _assemble(b: GraphBuilder, graph_inputs: list[Value], results: list, names: list[str],
              graph_name: str, dim_names: dict[sympy.Symbol, str], stubs: dict | None = None) -> onnx.ModelProto:
    rename: dict[str, str] = {}
    produced = {out for node in b.nodes for out in node.output}
    for value, name in zip(results, names, strict=True):
        if str(value) in produced and str(value) not in rename:
            rename[str(value)] = name
        else:  # an input, a constant, or a value already returned under another name
            with b.node_context({PHASE: _alias_phase(name)}, name):
                alias = b.op("Identity", rename.get(str(value), value))
            rename[str(alias)] = name
    rename_values(b.nodes, rename)
    inputs = [helper.make_tensor_value_info(v, TORCH_TO_ONNX[v.dtype], _dims(v.shape, dim_names)) for v in graph_inputs]
    outputs = [
        helper.make_tensor_value_info(name, TORCH_TO_ONNX[value.dtype], _dims(value.shape, dim_names))
        for value, name in zip(results, names, strict=True)
    ]
    graph = helper.make_graph(b.nodes, graph_name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="bridge")
    b.write_initializers(model.graph, stubs)
    model.ir_version = IR_VERSION
    return model
