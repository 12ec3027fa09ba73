"""The op database: one ``OpRow`` per registered ONNX op and attribute variant that matters.

In the spirit of torch's OpInfo and onnxscript's TorchLibOpInfo rows: each row describes a
tiny model (one node, or a few for sequence ops), how to build its inputs, and which checks
apply (``grad``: the training step is compared with float64 finite differences; ``dynamic_batch``:
it converts with a symbolic batch; ``iree``: its training graph compiles with IREE; ``xfail``: a
known failure, with the reason). tests/test_op_db.py drives every row through the whole path
and docs/op_database.py renders the table of docs/models.md from these rows.

Input values are chosen so finite differences are meaningful: no exact ties for Max/ArgMax-like
ops (``distinct``), positive inputs for Log/Sqrt, ``|x| < 1`` for Asin/Atanh, > 1 for Acosh.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F  # noqa: N812
from helpers.single_op import ELEM
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

DATA, WEIGHT, CONST, ABSENT = "data", "weight", "const", "absent"
ELEM_ALL = {**ELEM, np.dtype(np.int32): onnx.TensorProto.INT32, np.dtype(np.uint8): onnx.TensorProto.UINT8,
            np.dtype(np.uint32): onnx.TensorProto.UINT32}
BATCH = 2  # the batch size of every row's model (dim 0 of each batched data input)
# The trainable Mul in front of ops whose float inputs are all data: values in [0.75, 1.25]
# keep the domains below (|unit| * 1.25 < 1, gt1 * 0.75 > 1).
PRESCALE_RANGE = (0.75, 1.25)
CHECKS = ("forward", "training", "dynamic", "iree")


@dataclass(frozen=True)
class Arg:
    """One node input: a graph input (``data``), a trainable initializer (``weight``) or an
    initializer that is not trained (``const``: static inputs, integer tensors)."""

    name: str
    shape: tuple[int, ...] = ()
    role: str = DATA
    values: str = "normal"  # normal | positive | gt1 | unit | distinct | int:<high> | bool | (see value)
    dtype: Any = np.float32
    value: Any = None  # an exact value (overrides shape/values/dtype)
    batched: bool = True  # data only: dim 0 is the batch

    def build(self, seed: int, batch: int) -> np.ndarray:
        """The value of this input; a batched data input gets ``batch`` as its dim 0."""
        if self.value is not None:
            return np.asarray(self.value)
        shape = self.shape
        if self.role == DATA and self.batched and shape:
            shape = (batch, *shape[1:])
        rng = np.random.default_rng(seed)
        return _values(rng, self.values, shape).astype(self.dtype)


def _values(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of a kind (see ``Arg.values``)."""
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "positive":
        return np.abs(rng.standard_normal(shape)) + 0.5
    if kind == "gt1":
        return np.abs(rng.standard_normal(shape)) + 1.5
    if kind == "unit":
        return rng.uniform(-0.75, 0.75, shape)
    if kind == "distinct":  # pairwise at least 0.05 apart, shuffled: no ties under perturbation
        size = int(np.prod(shape))
        return (rng.permutation(size) - size / 2).reshape(shape) * 0.05 + rng.uniform(-0.01, 0.01, shape)
    if kind.startswith("int:"):
        return rng.integers(0, int(kind[4:]), shape)
    if kind == "bool":
        return rng.random(shape) < 0.5
    raise ValueError(f"unknown value kind {kind!r}")


@dataclass(frozen=True)
class Node:
    """An extra node of a multi-node row (sequence ops: a sequence cannot be a model output)."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OpRow:
    """One ONNX op in one attribute variant, and which checks apply to it."""

    op_type: str
    variant: str
    args: tuple[Arg, ...]
    attrs: dict = field(default_factory=dict)
    opset: int = 18
    outputs: int = 1  # outputs of the op's node (the loss applies to the first model output)
    out_dtype: Any = np.float32  # of every model output, or a tuple: one per output
    grad: bool = True
    dynamic_batch: bool = True
    xfail: str | None = None
    xfail_checks: tuple[str, ...] = ("training", "dynamic", "iree")  # the checks ``xfail`` applies to
    iree: bool = True
    # The gradient oracle is the model run by ONNX's reference evaluator in float64. Where that is
    # not what bridge trains or computes, the oracle model differs: ``oracle_attrs`` (an inference
    # BatchNorm trains with batch statistics: training_mode=1) or ``oracle`` nodes that replace the
    # op's node, written from the ONNX spec (where the evaluator is wrong or float32-only).
    oracle_attrs: dict = field(default_factory=dict)
    oracle: tuple[Node, ...] = ()
    node_inputs: tuple[str, ...] | None = None  # the op node's inputs (default: every arg, in order)
    before: tuple[Node, ...] = ()  # nodes in front of the op's node
    after: tuple[Node, ...] = ()  # nodes after it; the last one's outputs are the model's
    # The torch function of the model (its inputs and weights by name, float64 tensors): where set,
    # the gradient oracle is its autograd, not finite differences (rows placed at kinks: ``kink``).
    twin: Callable[..., Any] | None = None
    # Float-list attributes bridge trains as the weights ``node.<attribute>`` (ai.onnx.ml's coefficients): the
    # oracle model (``oracle`` nodes) reads them as initializers of those names.
    attribute_weights: tuple[str, ...] = ()
    convert: dict = field(default_factory=dict)  # more to_training_onnx options of every conversion of the row

    @property
    def id(self) -> str:
        return f"{self.op_type}-{self.variant}"

    @property
    def prescale(self) -> bool:
        """Whether a trainable ``Mul(x, w_pre)`` feeds the first data input (no weight otherwise)."""
        return self.grad and not any(a.role == WEIGHT for a in self.args)

    @property
    def weights(self) -> list[str]:
        """The initializers bridge must train."""
        return ((["w_pre"] if self.prescale else []) + [a.name for a in self.args if a.role == WEIGHT]
                + [f"node.{name}" for name in self.attribute_weights])

    @property
    def domain(self) -> str:
        """The op's domain: ``op_type`` is ``<domain>::<OpType>`` outside the default one (the converter key)."""
        return self.op_type.rpartition("::")[0]

    def _seed(self, name: str) -> int:
        return zlib.crc32(f"{self.id}/{name}".encode())

    def inputs(self, batch: int = BATCH) -> dict[str, np.ndarray]:
        """The graph inputs (data args) at ``batch``."""
        return {a.name: a.build(self._seed(a.name), batch) for a in self.args if a.role == DATA}

    def initializers(self) -> dict[str, np.ndarray]:
        values = {a.name: a.build(self._seed(a.name), BATCH) for a in self.args if a.role in (WEIGHT, CONST)}
        if self.prescale:
            first = self._first_data()
            rng = np.random.default_rng(self._seed("w_pre"))
            values["w_pre"] = rng.uniform(*PRESCALE_RANGE, first.shape[1:]).astype(first.dtype)
        return values

    def _first_data(self) -> Arg:
        return next(a for a in self.args if a.role == DATA)

    def model(self, batch: int = BATCH, oracle: bool = False) -> onnx.ModelProto:
        """The row's model, its data inputs with dim 0 ``batch``; with ``oracle``, the model whose
        reference-evaluator run is the gradient oracle (``oracle_attrs``, ``oracle`` nodes)."""
        data = self.inputs(batch)
        outs = ("y",) + tuple(f"y{i}" for i in range(1, self.outputs))
        node_inputs = tuple(a.name for a in self.args) if self.node_inputs is None else self.node_inputs
        op_nodes = [helper.make_node(self.op_type.rpartition("::")[2], list(node_inputs), list(outs), name="node",
                                     domain=self.domain, **{**self.attrs, **(self.oracle_attrs if oracle else {})})]
        if oracle and self.oracle:
            op_nodes = _nodes(self.oracle, "oracle")
        nodes = _nodes(self.before, "before") + op_nodes + _nodes(self.after, "after")
        if self.prescale:
            first = self._first_data().name
            for node in nodes:
                node.input[:] = ["pre" if n == first else n for n in node.input]
            nodes.insert(0, helper.make_node("Mul", [first, "w_pre"], ["pre"], name="pre"))
        model_outputs = list(self.after[-1].outputs) if self.after else outs
        graph = helper.make_graph(
            nodes, self.id,
            [helper.make_tensor_value_info(k, ELEM_ALL[v.dtype], v.shape) for k, v in data.items()],
            [_value_info(n, t) for n, t in zip(model_outputs, self._out_dtypes(model_outputs), strict=True)],
            [numpy_helper.from_array(np.asarray(v), k) for k, v in self.initializers().items()],
        )
        if oracle:
            graph.initializer.extend(numpy_helper.from_array(np.asarray(self.attrs[name], np.float32), f"node.{name}")
                                     for name in self.attribute_weights)
        domains = [helper.make_opsetid(self.domain, 1)] if self.domain else []
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset), *domains])
        model.ir_version = 8 if self.opset <= 17 else 10
        model = onnx.shape_inference.infer_shapes(model)
        _complete_output_shapes(model, data)
        onnx.checker.check_model(model)
        return model

    def _out_dtypes(self, outputs) -> tuple:
        return self.out_dtype if isinstance(self.out_dtype, tuple) else (self.out_dtype,) * len(outputs)

    def oracle_model(self) -> onnx.ModelProto | None:
        """The model whose reference-evaluator run is the gradient oracle, where it is not the row's."""
        return self.model(oracle=True) if self.oracle or self.oracle_attrs else None


MAP_OUTPUT = "map"  # an out_dtype: a sequence of maps from int64 class labels to float32 (ai.onnx.ml ZipMap)


def _value_info(name: str, dtype: Any) -> onnx.ValueInfoProto:
    if isinstance(dtype, str) and dtype == MAP_OUTPUT:
        value = helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None)
        maps = helper.make_sequence_type_proto(helper.make_map_type_proto(onnx.TensorProto.INT64, value))
        return helper.make_value_info(name, maps)
    return helper.make_tensor_value_info(name, ELEM_ALL[np.dtype(dtype)], None)


def _nodes(nodes: tuple[Node, ...], prefix: str) -> list[onnx.NodeProto]:
    return [helper.make_node(n.op_type, list(n.inputs), list(n.outputs), name=f"{prefix}{i}", **n.attrs)
            for i, n in enumerate(nodes)]


def _complete_output_shapes(model: onnx.ModelProto, data: dict[str, np.ndarray]) -> None:
    """Output shapes that ONNX shape inference leaves out (ops defined as functions, e.g.
    GroupNormalization), from a run of ONNX's reference evaluator."""
    missing = [o for o in model.graph.output if o.type.HasField("tensor_type") and not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    values = dict(zip([o.name for o in model.graph.output], ReferenceEvaluator(model).run(None, data), strict=True))
    for output in missing:
        output.type.tensor_type.shape.SetInParent()
        for size in values[output.name].shape:
            output.type.tensor_type.shape.dim.add().dim_value = size


def x(shape=(2, 3, 4), values="normal", name="x", **kw) -> Arg:
    """A data input (batched)."""
    return Arg(name, tuple(shape), DATA, values, **kw)


def w(name: str, shape, values="normal", **kw) -> Arg:
    """A trainable initializer."""
    return Arg(name, tuple(shape), WEIGHT, values, **kw)


def c(name: str, value, dtype=np.int64) -> Arg:
    """A constant initializer with an exact value."""
    return Arg(name, role=CONST, value=np.asarray(value, dtype=dtype))


def absent() -> Arg:
    """An omitted optional node input."""
    return Arg("", role=ABSENT)


def const(name: str, value, dtype=np.float32) -> Node:
    """A Constant node (a float64 value stays float64 in the float64 oracle: exact constants)."""
    return Node("Constant", (), (name,), {"value": numpy_helper.from_array(np.asarray(value, dtype), name)})


def exact(name: str, value: float, like: str = "x") -> tuple[Node, Node]:
    """``value`` in double precision, cast like ``like`` (a constant float32 cannot hold exactly)."""
    return const(f"{name}64", value, np.float64), Node("CastLike", (f"{name}64", like), (name,))


def row(op_type: str, variant: str, *args: Arg, **options) -> OpRow:
    return OpRow(op_type, variant, tuple(args), **options)


def _elementwise() -> list[OpRow]:
    domains = {"Acos": "unit", "Asin": "unit", "Atanh": "unit", "Tan": "unit", "Acosh": "gt1",
               "Log": "positive", "Sqrt": "positive", "Reciprocal": "positive"}
    unary = ["Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Erf", "Exp",
             "Floor", "Log", "Neg", "Reciprocal", "Round", "Sign", "Sin", "Sinh", "Sqrt", "Tan"]
    rows = [row(op, "default", x(values=domains.get(op, "normal")))
            for op in unary]
    binary_other = {"Div": "positive", "Pow": "normal"}
    for op in ["Add", "Sub", "Mul", "Div", "Pow"]:
        base = "positive" if op == "Pow" else "normal"
        rows.append(row(op, "broadcast", x(values=base), w("other", (3, 1), binary_other.get(op, "normal"))))
    rows += [
        row("Add", "same_shape", x(), w("other", (3, 4))),
        row("Pow", "scalar_exponent", x(values="positive"), c("e", 2.0, np.float32)),
        row("Max", "two", x(values="distinct"), w("other", (3, 4), "distinct")),
        row("Max", "three_broadcast", x(values="distinct"), w("b", (4,), "distinct"), w("c", (3, 1), "distinct")),
        row("Min", "two", x(values="distinct"), w("other", (3, 4), "distinct")),
        row("Sum", "three", x(), w("b", (3, 4)), w("c", (4,))),
        row("Mean", "three", x(), w("b", (3, 4)), w("c", (4,))),
        row("Sum", "one", x()),
        row("Mod", "fmod_float", x(), w("other", (3, 4), "positive"), attrs={"fmod": 1}),
        row("Mod", "int", x(values="int:9", dtype=np.int64), c("m", [2, 3, 4, 5]), out_dtype=np.int64, grad=False),
        row("Where", "default", c("cond", np.random.default_rng(0).random((3, 4)) < 0.5, np.bool_), w("a", (3, 4)), x()),
        row("Clip", "min_max", x(), c("lo", -0.5, np.float32), c("hi", 0.7, np.float32)),
        row("Clip", "min_only", x(), c("lo", -0.5, np.float32)),
        row("Clip", "max_only", x(), absent(), c("hi", 0.7, np.float32)),
        row("Clip", "no_bounds", x()),
        row("Cast", "float_to_float", x(), attrs={"to": onnx.TensorProto.FLOAT}),
        row("Cast", "float_to_int64", x(), attrs={"to": onnx.TensorProto.INT64}, out_dtype=np.int64, grad=False),
        row("CastLike", "float", x(), c("like", np.zeros(1, np.float32), np.float32)),
        row("IsInf", "default", x(), out_dtype=np.bool_, grad=False),
        row("IsNaN", "default", x(), out_dtype=np.bool_, grad=False),
    ]
    for op in ["Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"]:
        rows.append(row(op, "broadcast", x(), c("other", np.zeros(4), np.float32), out_dtype=np.bool_, grad=False))
    for op in ["And", "Or", "Xor"]:
        rows.append(row(op, "default", x(values="bool", dtype=np.bool_), c("other", [True, False, True, False], np.bool_),
                        out_dtype=np.bool_, grad=False))
    rows.append(row("Not", "default", x(values="bool", dtype=np.bool_), out_dtype=np.bool_, grad=False))
    for op in ["BitwiseAnd", "BitwiseOr", "BitwiseXor"]:
        rows.append(row(op, "int64", x(values="int:16", dtype=np.int64), c("other", [3, 5, 6, 12]),
                        out_dtype=np.int64, grad=False))
    rows.append(row("BitwiseNot", "int64", x(values="int:16", dtype=np.int64), out_dtype=np.int64, grad=False))
    return rows


# Oracles written from the ONNX spec where the reference evaluator holds its constants in float32
# (HardSwish's alpha=1/6, Gelu's sqrt(2/pi) and 0.044715 are float32 attributes/constants of
# their function bodies) or gets the op wrong (Softmax before opset 13 ignores the flattening).
HARD_SWISH = (const("six", 6.0), const("half", 0.5), const("zero", 0.0), const("one", 1.0),
              Node("Div", ("x", "six"), ("x6",)), Node("Add", ("x6", "half"), ("lin",)),
              Node("Clip", ("lin", "zero", "one"), ("gate",)), Node("Mul", ("x", "gate"), ("y",)))
GELU_TANH = (*exact("k", np.sqrt(2 / np.pi)), *exact("c", 0.044715), const("half", 0.5), const("one", 1.0),
             Node("Mul", ("x", "x"), ("x2",)), Node("Mul", ("x2", "x"), ("x3",)), Node("Mul", ("x3", "c"), ("cx3",)),
             Node("Add", ("x", "cx3"), ("inner",)), Node("Mul", ("inner", "k"), ("kinner",)),
             Node("Tanh", ("kinner",), ("t",)), Node("Add", ("t", "one"), ("t1",)), Node("Mul", ("x", "t1"), ("xt",)),
             Node("Mul", ("xt", "half"), ("y",)))


def _flattened(op_type: str, axis: int = 1) -> tuple[Node, ...]:
    """Softmax/LogSoftmax before opset 13: over the input flattened to 2-D at ``axis``."""
    return (Node("Flatten", ("x",), ("flat",), {"axis": axis}), Node(op_type, ("flat",), ("soft",), {"axis": 1}),
            Node("Shape", ("x",), ("shape",)), Node("Reshape", ("soft", "shape"), ("y",)))


def _activations() -> list[OpRow]:
    plain = ["Relu", "Sigmoid", "Tanh", "Softplus", "Softsign", "Mish", "Selu"]
    rows = [row(op, "default", x()) for op in plain]
    rows += [
        row("LeakyRelu", "alpha", x(), attrs={"alpha": 0.3}),
        row("Elu", "alpha", x(), attrs={"alpha": 0.7}),
        row("Celu", "alpha", x(), attrs={"alpha": 1.3}),
        row("ThresholdedRelu", "alpha", x(), attrs={"alpha": 0.2}),
        row("HardSwish", "default", x(), oracle=HARD_SWISH),
        row("HardSigmoid", "alpha_beta", x(), attrs={"alpha": 0.3, "beta": 0.4}),
        row("Gelu", "none", x(), opset=20),
        row("Gelu", "tanh", x(), opset=20, attrs={"approximate": "tanh"}, oracle=GELU_TANH),
        row("PRelu", "broadcast_slope", x(), w("slope", (3, 1), "positive")),
        row("Softmax", "axis1_opset13", x(), opset=13, attrs={"axis": 1}),
        row("Softmax", "axis-1", x(), attrs={"axis": -1}),
        row("Softmax", "axis1_opset11", x(), opset=11, attrs={"axis": 1}, oracle=_flattened("Softmax")),
        row("LogSoftmax", "axis-1", x(), attrs={"axis": -1}),
        row("LogSoftmax", "axis1_opset11", x(), opset=11, attrs={"axis": 1}, oracle=_flattened("LogSoftmax")),
        row("Hardmax", "axis2", x(values="distinct"), attrs={"axis": 2}, grad=False),
    ]
    return rows


REDUCE_VALUES = {"ReduceLogSum": "positive", "ReduceMax": "distinct", "ReduceMin": "distinct"}



def _reductions() -> list[OpRow]:
    ops = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]
    rows = []
    for op in ops:
        values = REDUCE_VALUES.get(op, "normal")
        for keep in (1, 0):
            rows.append(row(op, f"axes_keepdims{keep}", x(values=values), c("axes", [1, -1]), attrs={"keepdims": keep}))
    rows += [
        row("ReduceSum", "all_axes_keepdims0", x(), attrs={"keepdims": 0}, dynamic_batch=False),
        row("ReduceSum", "noop_with_empty_axes", x(), attrs={"noop_with_empty_axes": 1}),
        row("ReduceMean", "axes_attribute_opset13", x(), opset=13, attrs={"axes": [2], "keepdims": 0}),
        row("ReduceMax", "axes_attribute_opset13", x(values="distinct"), opset=13, attrs={"axes": [1]}),
        row("ReduceSum", "axes_input_opset13", x(), c("axes", [2]), opset=13, attrs={"keepdims": 0}),
        row("ArgMax", "axis1", x(values="distinct"), attrs={"axis": 1, "keepdims": 0}, out_dtype=np.int64, grad=False),
        row("ArgMax", "last_index", x(values="distinct"), attrs={"axis": 2, "select_last_index": 1},
            out_dtype=np.int64, grad=False),
        row("ArgMin", "axis1", x(values="distinct"), attrs={"axis": 1, "keepdims": 0}, out_dtype=np.int64, grad=False),
        row("CumSum", "axis1", x(), c("axis", 1)),
        row("CumSum", "exclusive_reverse", x(), c("axis", 2), attrs={"exclusive": 1, "reverse": 1}),
        row("CumSum", "int32", x(values="int:9", dtype=np.int32), c("axis", 1, np.int32), out_dtype=np.int32,
            grad=False),
    ]
    return rows


def _linear() -> list[OpRow]:
    return [
        row("Gemm", "bias", x((2, 4)), w("W", (4, 3)), w("C", (3,))),
        row("Gemm", "transB_alpha_beta", x((2, 4)), w("W", (3, 4)), w("C", (1, 3)),
            attrs={"transB": 1, "alpha": 0.5, "beta": 2.0}),
        row("Gemm", "transA", x((4, 2), batched=False), w("W", (4, 3)), attrs={"transA": 1}, dynamic_batch=False),
        row("Gemm", "no_bias", x((2, 4)), w("W", (4, 3))),
        row("MatMul", "3d_2d", x(), w("W", (4, 5))),
        row("MatMul", "2d_2d", x((2, 4)), w("W", (4, 3))),
        row("MatMul", "broadcast_batch", x((2, 3, 4)), w("W", (1, 4, 2))),
        row("MatMul", "vector", x(), w("v", (4,))),
        row("Einsum", "bij_jk", x(), w("W", (4, 5)), attrs={"equation": "bij,jk->bik"}),
        row("Einsum", "transpose", x(), attrs={"equation": "bij->bji"}),
        row("Einsum", "contract_vector", x(), w("v", (4,)), attrs={"equation": "bij,j->bi"}),
        row("Einsum", "outer", x((2, 3)), w("v", (4,)), attrs={"equation": "bi,j->bij"}),
        row("Einsum", "diagonal", x((2, 3, 3)), attrs={"equation": "bii->bi"}),
    ]


def _conv() -> list[OpRow]:
    x2 = x((2, 3, 6, 6))
    return [
        row("Conv", "2d_padded_bias", x2, w("W", (4, 3, 3, 3)), w("B", (4,)), attrs={"pads": [1, 1, 1, 1]}),
        row("Conv", "2d_strided", x2, w("W", (4, 3, 3, 3)), attrs={"strides": [2, 2]}),
        row("Conv", "2d_grouped", x2, w("W", (6, 1, 3, 3)), w("B", (6,)), attrs={"group": 3}),
        row("Conv", "2d_grouped2", x((2, 4, 5, 5)), w("W", (6, 2, 3, 3)), attrs={"group": 2}),
        row("Conv", "2d_dilated", x2, w("W", (4, 3, 2, 2)), attrs={"dilations": [2, 2]}),
        row("Conv", "2d_asymmetric_pads", x2, w("W", (4, 3, 3, 3)), attrs={"pads": [0, 1, 1, 0]}),
        row("Conv", "2d_same_upper_strided", x2, w("W", (4, 3, 3, 3)), attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        row("Conv", "1d_padded", x((2, 3, 8)), w("W", (4, 3, 3)), w("B", (4,)), attrs={"pads": [1, 1]}),
        row("Conv", "3d", x((2, 2, 4, 4, 4)), w("W", (3, 2, 2, 2, 2)), w("B", (3,))),
        row("ConvTranspose", "2d", x((2, 3, 4, 4)), w("W", (3, 2, 3, 3)), w("B", (2,))),
        row("ConvTranspose", "2d_stride2_pads_output_padding", x((2, 3, 4, 4)), w("W", (3, 2, 3, 3)),
            attrs={"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}),
        # The reference evaluator's ConvTranspose has no groups: the oracle convolves each group.
        row("ConvTranspose", "2d_grouped", x((2, 4, 3, 3)), w("W", (4, 1, 2, 2)), attrs={"group": 2, "strides": [2, 2]},
            oracle=(Node("Split", ("x",), ("x0", "x1"), {"axis": 1, "num_outputs": 2}),
                    Node("Split", ("W",), ("w0", "w1"), {"axis": 0, "num_outputs": 2}),
                    Node("ConvTranspose", ("x0", "w0"), ("y0",), {"strides": [2, 2]}),
                    Node("ConvTranspose", ("x1", "w1"), ("y1",), {"strides": [2, 2]}),
                    Node("Concat", ("y0", "y1"), ("y",), {"axis": 1}))),
        row("ConvTranspose", "1d_strided", x((2, 3, 5)), w("W", (3, 2, 3)), attrs={"strides": [2]}),
    ]


def _pool() -> list[OpRow]:
    x2 = x((2, 3, 6, 6), "distinct")
    rows = [
        row("MaxPool", "2d_k2s2", x2, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
        row("MaxPool", "2d_k3_pads", x2, attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
        row("MaxPool", "2d_ceil_mode", x2, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
        row("MaxPool", "2d_dilated", x2, attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}),
        row("MaxPool", "1d", x((2, 3, 8), "distinct"), attrs={"kernel_shape": [3], "strides": [2]}),
        row("MaxPool", "3d", x((2, 2, 4, 4, 4), "distinct"), attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
        row("GlobalMaxPool", "2d", x((2, 3, 4, 4), "distinct")),
        row("GlobalAveragePool", "2d", x((2, 3, 4, 4))),
        row("GlobalAveragePool", "1d", x((2, 3, 5))),
        # onnx's reference evaluator has no GlobalLpPool: the oracle is the same norm as ReduceL2 / ReduceL1.
        row("GlobalLpPool", "2d_p2", x((2, 3, 4, 4)),
            oracle=(const("axes", [2, 3], np.int64), Node("ReduceL2", ("x", "axes"), ("y",)))),
        row("GlobalLpPool", "1d_p1", x((2, 3, 5)), attrs={"p": 1},
            oracle=(const("axes", [2], np.int64), Node("ReduceL1", ("x", "axes"), ("y",)))),
        row("GlobalLpPool", "2d_p3", x((2, 3, 4, 4)), attrs={"p": 3},
            oracle=(Node("LpPool", ("x",), ("y",), {"kernel_shape": [4, 4], "p": 3}),)),
    ]
    x2 = x((2, 3, 6, 6))
    rows += [
        row("AveragePool", "2d_k2s2", x2, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
        row("AveragePool", "2d_pads_exclude", x2, attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
        row("AveragePool", "2d_pads_include", x2, attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
        row("AveragePool", "2d_ceil_mode", x2, attrs={"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
        row("AveragePool", "1d", x((2, 3, 8)), attrs={"kernel_shape": [3], "strides": [2]}),
        row("AveragePool", "3d", x((2, 2, 4, 4, 4)), attrs={"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
    ]
    return rows


def _mvn(axes: list[int]) -> tuple[Node, ...]:
    """MeanVarianceNormalization's function body (its float32 epsilon stops the evaluator in float64)."""
    return (const("axes", axes, np.int64), *exact("eps", 1e-9),
            Node("ReduceMean", ("x", "axes"), ("mean",)), Node("Mul", ("x", "x"), ("sq",)),
            Node("ReduceMean", ("sq", "axes"), ("mean_sq",)), Node("Mul", ("mean", "mean"), ("sq_mean",)),
            Node("Sub", ("mean_sq", "sq_mean"), ("var",)), Node("Sqrt", ("var",), ("std",)),
            Node("Add", ("std", "eps"), ("den",)), Node("Sub", ("x", "mean"), ("centered",)),
            Node("Div", ("centered", "den"), ("y",)))


def _normalization() -> list[OpRow]:
    stats = (c("mean", [0.1, -0.2, 0.3], np.float32), c("var", [0.5, 1.5, 2.0], np.float32))
    return [
        row("BatchNormalization", "inference_model", x((2, 3, 4, 4)), w("scale", (3,)), w("bias", (3,)), *stats,
            oracle_attrs={"training_mode": 1}),
        row("BatchNormalization", "2d_input", x((4, 3)), w("scale", (3,)), w("bias", (3,)), *stats,
            oracle_attrs={"training_mode": 1}, dynamic_batch=False),  # batch 1: one value per channel
        row("BatchNormalization", "training_mode", x((2, 3, 4, 4)), w("scale", (3,)), w("bias", (3,)), *stats,
            attrs={"training_mode": 1}, outputs=3),
        # batch_norm="frozen": the running statistics normalize, as the inference model means (its own oracle)
        row("BatchNormalization", "frozen", x((2, 3, 4, 4)), w("scale", (3,)), w("bias", (3,)), *stats,
            convert={"batch_norm": "frozen"}),
        row("LayerNormalization", "last_axis", x(), w("scale", (4,)), w("bias", (4,))),
        row("LayerNormalization", "axis1_no_bias", x(), w("scale", (3, 4)), attrs={"axis": 1}),
        row("InstanceNormalization", "2d", x((2, 3, 4, 4)), w("scale", (3,)), w("B", (3,))),
        # stash_type defaults to float32 statistics: the float64 oracle needs double ones.
        row("GroupNormalization", "opset21", x((2, 4, 3, 3)), w("scale", (4,)), w("bias", (4,)), opset=21,
            attrs={"num_groups": 2}, oracle_attrs={"stash_type": onnx.TensorProto.DOUBLE}),
        row("LpNormalization", "p2_last_axis", x(), attrs={"p": 2, "axis": -1}),
        row("LpNormalization", "p1_axis1", x(), attrs={"p": 1, "axis": 1},
            oracle=(const("axes", [1], np.int64), Node("ReduceL1", ("x", "axes"), ("norm",)), Node("Div", ("x", "norm"), ("y",)))),
        row("MeanVarianceNormalization", "default_axes", x((2, 3, 4, 4)), oracle=_mvn([0, 2, 3])),
        row("MeanVarianceNormalization", "spatial_axes", x((2, 3, 4, 4)), attrs={"axes": [2, 3]}, oracle=_mvn([2, 3])),
    ]


def _dropout() -> list[OpRow]:
    return [
        row("Dropout", "ratio_input", x(), c("ratio", 0.25, np.float32)),
        row("Dropout", "ratio_attribute_opset11", x(), opset=11, attrs={"ratio": 0.25}),
        row("Dropout", "default_ratio", x()),
    ]


def _const_then_affine(op_type: str, variant: str, node_inputs: tuple[str, ...], *args: Arg, shape=(3, 4), **options) -> OpRow:
    """A row whose op makes a value from constants only: ``x * w + op(...)`` makes it train."""
    after = (Node("Mul", ("x", "w"), ("xw",)), Node("Add", ("xw", "y"), ("z",)))
    return row(op_type, variant, x((2, *shape)), w("w", shape), *args, node_inputs=node_inputs, after=after, **options)


def _tensor() -> list[OpRow]:
    value = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "value")
    seq = (2, 3, 4)
    return [
        row("Identity", "tensor", x()),
        _const_then_affine("Constant", "value", (), attrs={"value": value}),
        _const_then_affine("Constant", "value_float", (), attrs={"value_float": 0.5}),
        _const_then_affine("ConstantOfShape", "value", ("shape",), c("shape", [3, 4]),
                           attrs={"value": numpy_helper.from_array(np.array([0.5], np.float32), "value")}),
        _const_then_affine("Range", "float", ("start", "limit", "delta"), c("start", 0.5, np.float32),
                           c("limit", 2.5, np.float32), c("delta", 0.5, np.float32), shape=(4,)),
        _const_then_affine("OneHot", "axis-1", ("indices", "depth", "values"), c("indices", [0, 3, 1]), c("depth", 4),
                           c("values", [-0.5, 2.0], np.float32)),
        row("Shape", "default", x(), out_dtype=np.int64, grad=False),
        row("Shape", "start_end", x(), attrs={"start": 1, "end": -1}, out_dtype=np.int64, grad=False),
        row("Size", "default", x(), out_dtype=np.int64, grad=False),
        row("Reshape", "keep_batch", x(), c("shape", [0, -1])),
        row("Reshape", "fold_batch", x(), c("shape", [-1, 4]), dynamic_batch=False),
        row("Flatten", "axis1", x((2, 3, 2, 2))),
        row("Flatten", "axis2", x((2, 3, 2, 2)), attrs={"axis": 2}),
        row("Flatten", "axis0", x(), attrs={"axis": 0}, dynamic_batch=False),
        row("Flatten", "negative_axis", x((2, 3, 2, 2)), attrs={"axis": -1}),
        row("Transpose", "perm", x(), attrs={"perm": [0, 2, 1]}),
        row("Transpose", "default_reverse", x(), dynamic_batch=False),
        row("Squeeze", "axes", x((2, 1, 4)), c("axes", [1])),
        row("Squeeze", "no_axes", x((2, 1, 4)), dynamic_batch=False),
        row("Unsqueeze", "axes", x(), c("axes", [1, -1])),
        row("Concat", "axis1_two_inputs", x(), x((2, 2, 4), name="x2"), attrs={"axis": 1}),
        row("Concat", "axis-1_weight", x(), w("other", (2, 3, 2)), attrs={"axis": -1}, dynamic_batch=False),
        row("Split", "split_input", x(), c("split", [1, 2]), attrs={"axis": 1}, outputs=2),
        row("Split", "num_outputs", x(), attrs={"axis": 2, "num_outputs": 2}, outputs=2),
        row("Split", "attribute_opset11", x(), opset=11, attrs={"axis": 2, "split": [3, 1]}, outputs=2),
        row("Slice", "steps", x(), c("starts", [0, 1]), c("ends", [2, 100]), c("axes", [1, 2]), c("steps", [1, 2])),
        row("Slice", "negative_step", x(), c("starts", [-1]), c("ends", [-100]), c("axes", [2]), c("steps", [-1])),
        row("Slice", "step_minus2", x(), c("starts", [-1]), c("ends", [-100]), c("axes", [2]), c("steps", [-2])),
        row("Slice", "negative_axes_no_steps", x(), c("starts", [1]), c("ends", [-1]), c("axes", [-1])),
        row("Slice", "default_axes", x(), c("starts", [0, 1]), c("ends", [2**62, 3])),
        row("Gather", "axis1_2d_indices", x(), c("indices", [[2, 0], [1, 1]]), attrs={"axis": 1}),
        row("Gather", "negative_indices", x(), c("indices", [-1, 0]), attrs={"axis": 2}),
        row("Gather", "embedding", w("table", (6, 4)), x((2, 3), "int:6", dtype=np.int64, name="ids")),
        row("GatherElements", "axis1", x(), x(seq, "int:3", dtype=np.int64, name="indices"), attrs={"axis": 1},
            xfail="symbolic batch: TypeError '<' not supported between instances of 'Value' and 'int' while "
                  "exporting (see the op_db report)", xfail_checks=("dynamic",)),
        row("GatherND", "batch_dims1", x(), x((2, 1), "int:3", dtype=np.int64, name="indices"), attrs={"batch_dims": 1}),
        row("GatherND", "table", w("table", (5, 4)), x((2, 1), "int:5", dtype=np.int64, name="indices")),
        row("Expand", "broadcast", x((2, 1, 4)), c("shape", [1, 3, 1])),
        row("Tile", "repeats", x(), c("repeats", [1, 2, 1])),
        row("Pad", "constant_value", x(), c("pads", [0, 1, 0, 0, 2, 1]), c("value", 1.5, np.float32)),
        row("Pad", "constant_axes", x(), c("pads", [1, 2]), c("value", 0.0, np.float32), c("axes", [-1])),
        row("Pad", "reflect", x(), c("pads", [0, 1, 1, 0, 1, 2]), attrs={"mode": "reflect"}),
        row("Pad", "edge", x(), c("pads", [0, 0, 1, 0, 0, 2]), attrs={"mode": "edge"}),
        row("Trilu", "upper_k1", x(), c("k", 1)),
        row("Trilu", "lower", x(), attrs={"upper": 0}),
        row("DepthToSpace", "DCR", x((2, 8, 2, 3)), attrs={"blocksize": 2}),
        row("DepthToSpace", "CRD", x((2, 8, 2, 3)), attrs={"blocksize": 2, "mode": "CRD"}),
        row("SpaceToDepth", "blocksize2", x((2, 2, 4, 6)), attrs={"blocksize": 2}),
    ]


def _resize() -> list[OpRow]:
    x2 = x((2, 3, 4, 4))
    scales2 = c("scales", [1, 1, 2, 2], np.float32)
    return [
        row("Resize", "nearest_asymmetric_floor", x2, absent(), scales2,
            attrs={"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
        row("Resize", "nearest_default", x2, absent(), scales2),
        row("Resize", "linear_half_pixel", x2, absent(), scales2, attrs={"mode": "linear"}),
        row("Resize", "linear_align_corners_sizes", x2, absent(), absent(), c("sizes", [2, 3, 7, 7]),
            attrs={"mode": "linear", "coordinate_transformation_mode": "align_corners"}, dynamic_batch=False),
        row("Resize", "linear_downsample", x((2, 3, 8, 8)), absent(), c("scales", [1, 1, 0.5, 0.5], np.float32),
            attrs={"mode": "linear"}),
        row("Resize", "cubic", x2, absent(), scales2, attrs={"mode": "cubic"}),
        row("Resize", "sizes_axes", x2, absent(), absent(), c("sizes", [6, 7]), attrs={"mode": "linear", "axes": [2, 3]}),
        row("Upsample", "nearest_opset9", x2, c("scales", [1, 1, 2, 2], np.float32), opset=9),
    ]


def _recurrent(op: str, gates: int, variant: str, directions: int = 1, layout: int = 0, **attrs) -> OpRow:
    """seq 3, batch 2, input 4, hidden 5; layout 0 puts the batch in dim 1 (no symbolic batch)."""
    shape = (2, 3, 4) if layout else (3, 2, 4)
    direction = {1: "forward", 2: "bidirectional"}[directions] if "direction" not in attrs else attrs.pop("direction")
    return row(op, variant, x(shape, batched=bool(layout)), w("W", (directions, gates * 5, 4)),
               w("R", (directions, gates * 5, 5)), w("B", (directions, 2 * gates * 5)),
               attrs={"hidden_size": 5, "direction": direction, "layout": layout, **attrs}, outputs=2,
               dynamic_batch=bool(layout))


def _rnn() -> list[OpRow]:
    return [
        _recurrent("RNN", 1, "forward"),
        _recurrent("RNN", 1, "reverse", direction="reverse"),
        _recurrent("RNN", 1, "bidirectional_batch_first", 2, layout=1),
        _recurrent("GRU", 3, "forward"),
        _recurrent("GRU", 3, "linear_before_reset", linear_before_reset=1),
        _recurrent("GRU", 3, "bidirectional_batch_first", 2, layout=1),
        _recurrent("LSTM", 4, "forward"),
        _recurrent("LSTM", 4, "bidirectional", 2),
        _recurrent("LSTM", 4, "reverse_batch_first", layout=1, direction="reverse"),
    ]


def _sequence() -> list[OpRow]:
    split = Node("SplitToSequence", ("x",), ("seq",), {"axis": 1})
    at = Node("SequenceAt", ("y", "pos"), ("z",))
    pos = c("pos", 1)
    return [
        row("SplitToSequence", "axis1_then_at", x(), pos, node_inputs=("x",), attrs={"axis": 1}, after=(at,)),
        row("SplitToSequence", "split_sizes", x(), c("split", [1, 3]), pos, node_inputs=("x", "split"),
            attrs={"axis": 2}, after=(at,)),
        row("SequenceAt", "negative_position", x(), c("pos", -1), node_inputs=("seq", "pos"), before=(split,)),
        row("SequenceConstruct", "then_concat", x(), x(name="x2"), node_inputs=("x", "x", "x2"),
            after=(Node("ConcatFromSequence", ("y",), ("z",), {"axis": 2}),)),
        row("ConcatFromSequence", "axis1", x(), node_inputs=("seq",), before=(split,), attrs={"axis": 1}),
        row("ConcatFromSequence", "new_axis", x(), node_inputs=("seq",), before=(split,), attrs={"axis": 1, "new_axis": 1}),
        row("SequenceLength", "after_split", x(), node_inputs=("seq",), before=(split,), out_dtype=np.int64, grad=False,
            dynamic_batch=False),
        row("Identity", "sequence", x(), pos, node_inputs=("seq",), before=(split,), after=(at,)),
    ]


# --- issue 12 part A ---
def _scaled_data(shape) -> tuple[Arg, Arg, Node]:
    """A data input times a trainable weight: the op's ``data`` input whose gradient is checked."""
    return x(shape), w("wd", shape[1:]), Node("Mul", ("x", "wd"), ("data",))


def _scatter(op_type: str, variant: str, shape, indices: Arg, updates: Arg, **options) -> OpRow:
    """A scatter into ``x * wd`` (both ``wd`` and the updates trained)."""
    data, wd, mul = _scaled_data(shape)
    return row(op_type, variant, data, wd, indices, updates, node_inputs=("data", indices.name, updates.name),
               before=(mul,), **options)


def _scatters() -> list[OpRow]:
    idx = c("indices", [[[1, 0, -1, 1], [-1, 1, 0, 0]]])  # no duplicate along axis 1 (-1 is 2)
    dup = c("indices", [[[1, 0, 2, 1], [1, 1, 0, 2]]])  # column 0 hits position 1 twice
    upd = w("updates", (1, 2, 4), "distinct")
    nd_idx = c("indices", [[1], [0]])
    nd_dup = c("indices", [[1, 2], [0, 0], [1, 2]])
    # mul/max/min train too (each op has one such row; the node suite's gradients cover the rest)
    bonus = {"grad": False, "dynamic_batch": False}
    return [
        _scatter("ScatterElements", "none_axis1", (2, 3, 4), idx, upd, attrs={"axis": 1}, dynamic_batch=False),
        _scatter("ScatterElements", "add_duplicates", (2, 3, 4), dup, upd, attrs={"axis": 1, "reduction": "add"}, dynamic_batch=False),
        _scatter("ScatterElements", "mul_duplicates", (2, 3, 4), dup, upd, attrs={"axis": 1, "reduction": "mul"}, **bonus),
        _scatter("ScatterElements", "max", (2, 3, 4), dup, upd, attrs={"axis": 1, "reduction": "max"}, dynamic_batch=False),
        _scatter("ScatterElements", "min", (2, 3, 4), dup, upd, attrs={"axis": 1, "reduction": "min"}, **bonus),
        _scatter("ScatterElements", "axis-1_data_indices", (2, 3, 4), x((2, 3, 2), "int:4", dtype=np.int64, name="ids"),
                 w("updates", (2, 3, 2)), attrs={"axis": -1}, dynamic_batch=False),
        _scatter("ScatterND", "none_rows", (2, 3, 4), nd_idx, w("updates", (2, 3, 4)), dynamic_batch=False),
        _scatter("ScatterND", "none_depth2", (2, 3, 4), c("indices", [[1, 2], [0, 0]]), w("updates", (2, 4)),
                 dynamic_batch=False),
        _scatter("ScatterND", "add_duplicates", (2, 3, 4), nd_dup, w("updates", (3, 4)), attrs={"reduction": "add"},
                 dynamic_batch=False),
        _scatter("ScatterND", "mul_duplicates", (2, 3, 4), nd_dup, w("updates", (3, 4)), attrs={"reduction": "mul"},
                 dynamic_batch=False),
        _scatter("ScatterND", "max", (2, 3, 4), nd_dup, w("updates", (3, 4), "distinct"), attrs={"reduction": "max"},
                 **bonus),
        _scatter("ScatterND", "min", (2, 3, 4), nd_dup, w("updates", (3, 4), "distinct"), attrs={"reduction": "min"},
                 **bonus),
    ]


def _topk(variant: str, *args: Arg, **options) -> OpRow:
    """TopK with both outputs (the loss trains through the values)."""
    return row("TopK", variant, x(values="distinct"), *args, outputs=2, out_dtype=(np.float32, np.int64), **options)


def _selection() -> list[OpRow]:
    return [
        _topk("largest_last_axis", c("k", [2])),
        _topk("smallest_axis1", c("k", [2]), attrs={"axis": 1, "largest": 0}),
        _topk("k_attribute_opset9", opset=9, attrs={"axis": 2, "k": 3}, grad=False),
        row("GatherND", "depth2_negative", x(), c("indices", [[1, -1], [0, 2]]), dynamic_batch=False),
        row("GatherND", "batch_dims1_depth2", x((2, 3, 4, 2)), x((2, 2, 2), "int:3", dtype=np.int64, name="indices"),
            attrs={"batch_dims": 1}),
        row("Gather", "scalar_index", x(), c("indices", 1), attrs={"axis": 1}),
    ]


def _folded() -> list[OpRow]:
    """Ops whose output size depends on values known before the model runs."""
    uniq = c("u", [[1.5, 0.5], [1.5, 0.5], [2.0, -1.0], [0.5, 0.5]], np.float32)
    unique = {"outputs": 4, "out_dtype": (np.float32, np.int64, np.int64, np.int64), "grad": False}
    return [
        row("NonZero", "constant", c("v", [[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]], np.float32), out_dtype=np.int64,
            grad=False),
        row("Compress", "axis1", x(), c("condition", [True, False, True], np.bool_), attrs={"axis": 1}),
        row("Compress", "flattened_short_condition", x(), c("condition", [False, True, True, False, True], np.bool_),
            grad=False),
        row("Unique", "sorted_flat", uniq, **unique),
        row("Unique", "unsorted_flat", uniq, attrs={"sorted": 0}, **unique),
        row("Unique", "axis0", uniq, attrs={"axis": 0}, **unique),
    ]


def _lrn(variant: str, shape, size: int, alpha: float, beta: float, bias: float = 1.0) -> OpRow:
    """LRN with an oracle from the spec (the reference evaluator's LRN windows over the batch dim, not
    the channels): squares padded along the channels, ``size`` shifted slices summed."""
    channels, before, after = shape[1], (size - 1) // 2, size // 2
    slices = []
    for k in range(size):
        slices += [const(f"s{k}", [k], np.int64), const(f"e{k}", [k + channels], np.int64),
                   Node("Slice", ("padded", f"s{k}", f"e{k}", "axis1"), (f"win{k}",))]
    oracle = (const("pads", [0, before, 0, 0, 0, after, 0, 0], np.int64), const("axis1", [1], np.int64),
              *exact("scale", float(np.float32(alpha)) / size), *exact("bias", float(np.float32(bias))),
              *exact("beta", float(np.float32(beta))), Node("Mul", ("x", "x"), ("sq",)),
              Node("Pad", ("sq", "pads"), ("padded",)), *slices,
              Node("Sum", tuple(f"win{k}" for k in range(size)), ("window",)), Node("Mul", ("window", "scale"), ("scaled",)),
              Node("Add", ("scaled", "bias"), ("base",)), Node("Pow", ("base", "beta"), ("den",)),
              Node("Div", ("x", "den"), ("y",)))
    attrs = {"size": size, "alpha": alpha, "beta": beta, "bias": bias}
    return row("LRN", variant, x(shape), attrs=attrs, oracle=oracle)


def _local() -> list[OpRow]:
    """Element-wise and channel-window ops, sequence reversal and bit shifts."""
    return [
        row("Shrink", "soft", x(), attrs={"lambd": 0.5, "bias": 0.5}),
        row("Shrink", "hard", x(), attrs={"lambd": 0.3}),
        _lrn("size3", (2, 5, 3, 3), size=3, alpha=0.2, beta=0.75, bias=1.5),
        _lrn("size5_default_bias", (2, 6, 2, 3), size=5, alpha=0.3, beta=0.5),
        row("ReverseSequence", "time_major", x((4, 2, 3), batched=False), c("lens", [4, 2]),
            attrs={"time_axis": 0, "batch_axis": 1}, dynamic_batch=False),
        row("ReverseSequence", "batch_major_data_lengths", x((2, 4, 3)), x((2,), "int:5", dtype=np.int64, name="lens"),
            attrs={"time_axis": 1, "batch_axis": 0}),
        row("BitShift", "left_uint8", x((2, 4), "int:16", dtype=np.uint8), c("s", [1, 2, 3, 0], np.uint8),
            attrs={"direction": "LEFT"}, out_dtype=np.uint8, grad=False),
        row("BitShift", "right_uint32", x((2, 4), "int:4096", dtype=np.uint32), c("s", [1, 2, 3, 0], np.uint32),
            attrs={"direction": "RIGHT"}, out_dtype=np.uint32, grad=False),
    ]


def _grid_samples() -> list[OpRow]:
    """Grids in about [-2, 2]: a third of the points sample outside the input (padding)."""
    x2, grid = x((2, 2, 3, 4)), w("grid", (2, 2, 3, 2))
    fixed = c("grid", np.random.default_rng(1).uniform(-1.3, 1.3, (2, 2, 3, 2)), np.float32)
    static = {"dynamic_batch": False}
    return [
        row("GridSample", "bilinear_zeros", x2, grid, opset=16, **static),
        row("GridSample", "bilinear_border_align_corners", x2, grid, opset=16,
            attrs={"padding_mode": "border", "align_corners": 1}, **static),
        row("GridSample", "nearest_zeros", x2, fixed, opset=16, attrs={"mode": "nearest"}, **static),
        row("GridSample", "bicubic_zeros", x2, grid, opset=16, attrs={"mode": "bicubic"}, **static),
        row("GridSample", "cubic_reflection", x2, grid, opset=20, attrs={"mode": "cubic", "padding_mode": "reflection"},
            **static),
        row("GridSample", "linear_3d_border", x((2, 1, 2, 3, 3)), w("grid", (2, 1, 2, 2, 3)), opset=20,
            attrs={"padding_mode": "border"}, **static),
        row("GridSample", "data_grid", x2, x((2, 2, 3, 2), name="g"), opset=16),
    ]


def _pool_and_resize() -> list[OpRow]:
    """AveragePool dilations (opset 19) and Resize antialias when downsampling (opset 18)."""
    x2, x8 = x((2, 3, 6, 6)), x((2, 2, 8, 8))
    return [
        row("AveragePool", "2d_dilated_opset19", x2, opset=19, attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}),
        row("AveragePool", "2d_dilated_pads_ceil_include", x2, opset=19,
            attrs={"kernel_shape": [3, 3], "dilations": [2, 2], "strides": [2, 2], "pads": [1, 1, 2, 2],
                   "ceil_mode": 1, "count_include_pad": 1}),
        row("AveragePool", "1d_dilated_pads_exclude", x((2, 3, 9)), opset=19,
            attrs={"kernel_shape": [3], "dilations": [3], "pads": [2, 1]}),
        row("Resize", "linear_antialias_downsample", x8, absent(), c("scales", [1, 1, 0.5, 0.375], np.float32),
            opset=18, attrs={"mode": "linear", "antialias": 1}),
        row("Resize", "cubic_antialias_sizes", x8, absent(), absent(), c("sizes", [2, 2, 3, 5]),
            opset=18, attrs={"mode": "cubic", "antialias": 1}, grad=False),
        row("Resize", "cubic_antialias_exclude_outside", x8, absent(), c("scales", [1, 1, 0.5, 0.5], np.float32),
            opset=18, attrs={"mode": "cubic", "antialias": 1, "exclude_outside": 1}),
    ]


def _issue12a() -> list[OpRow]:
    return _scatters() + _selection() + _folded() + _local() + _grid_samples() + _pool_and_resize()
# --- issue 12 part B ---
# Control flow (subgraphs read outer-scope values), sequences, DFT and windows, quantization, NMS.
ELEM_ALL.update({np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.int8): onnx.TensorProto.INT8,
                 np.dtype(np.int32): onnx.TensorProto.INT32})


def _graph(nodes: list[Node], inputs: dict[str, int], outputs: dict[str, int], name: str) -> onnx.GraphProto:
    """A subgraph (If branch, Loop/Scan body) with inputs and outputs ``{name: elem}`` (a Loop's
    iteration number and conditions are scalars, other shapes are left to inference)."""
    def info(value: str, elem: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(value, elem, [] if value in ("i", "cond_in", "cond_out") else None)
    return helper.make_graph(_nodes(tuple(nodes), name), name, [info(k, v) for k, v in inputs.items()],
                             [info(k, v) for k, v in outputs.items()])


F32, BOOL, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL, onnx.TensorProto.INT64
# Variants whose training path another row of the op already covers (this section's rows stay
# within the default tier's time budget): forward only. They pass finite differences too.
FORWARD_ONLY = dict(grad=False, dynamic_batch=False)


def _control_flow() -> list[OpRow]:
    then_branch = _graph([Node("Mul", ("x", "w"), ("t",))], {}, {"t": F32}, "then")
    else_branch = _graph([Node("Add", ("x", "w"), ("e",))], {}, {"e": F32}, "else")
    cell = [Node("Mul", ("h_in", "x_t"), ("p",)), Node("Add", ("p", "x_t"), ("q",)), Node("Tanh", ("q",), ("h_out",)),
            Node("Identity", ("h_out",), ("h_scan",))]
    scan_body = _graph(cell, {"h_in": F32, "x_t": F32}, {"h_out": F32, "h_scan": F32}, "scan_body")
    loop_body = _graph([Node("MatMul", ("h_in", "w"), ("m",)), Node("Tanh", ("m",), ("h_out",)),
                        Node("Identity", ("cond_in",), ("cond_out",)), Node("Mul", ("h_out", "h_out"), ("h_scan",))],
                       {"i": I64, "cond_in": BOOL, "h_in": F32}, {"cond_out": BOOL, "h_out": F32, "h_scan": F32}, "loop_body")
    counted_body = _graph([Node("Mul", ("h_in", "x"), ("h_out",)), const("last", 2, np.int64),
                           Node("Less", ("i", "last"), ("cond_out",))],
                          {"i": I64, "cond_in": BOOL, "h_in": F32}, {"cond_out": BOOL, "h_out": F32}, "counted_body")
    loop = dict(opset=17, node_inputs=("M", "cond", "x"))
    return [
        row("If", "then_reads_outer", x(), w("w", (3, 4)), c("cond", True, np.bool_), node_inputs=("cond",),
            attrs={"then_branch": then_branch, "else_branch": else_branch}, dynamic_batch=False),
        row("If", "else_reads_outer", x(), w("w", (3, 4)), c("cond", False, np.bool_), node_inputs=("cond",),
            attrs={"then_branch": then_branch, "else_branch": else_branch}, **FORWARD_ONLY),
        row("Loop", "carried_and_scan", x(shape=(2, 4)), w("w", (4, 4)), c("M", 3), c("cond", True, np.bool_),
            outputs=2, attrs={"body": loop_body}, **loop),
        # flattened: ONNX's reference evaluator concatenates 2-D scan outputs instead of stacking them
        row("Loop", "scan_output", x(shape=(2, 4)), w("w", (4, 4)), c("M", 3), c("cond", True, np.bool_), c("flat", [-1]),
            outputs=2, attrs={"body": loop_body}, after=(Node("Reshape", ("y1", "flat"), ("z",)),), **FORWARD_ONLY,
            **loop),
        row("Loop", "body_condition_no_trip_count", x(values="unit"), absent(), c("cond", True, np.bool_),
            attrs={"body": counted_body}, node_inputs=("", "cond", "x"), opset=17),
        row("Scan", "axis1", x(name="h0", shape=(2, 4)), x(shape=(2, 3, 4)), outputs=2, opset=17,
            attrs={"body": scan_body, "num_scan_inputs": 1, "scan_input_axes": [1]}, **FORWARD_ONLY),
        row("Scan", "reverse_output_axis1", x(name="h0", shape=(2, 4)), x(shape=(2, 3, 4)), outputs=2, opset=17,
            attrs={"body": scan_body, "num_scan_inputs": 1, "scan_input_axes": [1], "scan_input_directions": [1],
                   "scan_output_axes": [1], "scan_output_directions": [1]},
            after=(Node("Identity", ("y1",), ("z",)),), oracle=_scan_oracle(scan_body)),
    ]


def _scan_oracle(body: onnx.GraphProto) -> tuple[Node, ...]:
    """Scan over axis 1 with input and output directions 1 and output axis 1, written with axis 0
    and no directions (all that ONNX's reference evaluator implements): flips and transposes."""
    flip = [const("r_start", [-1], np.int64), const("r_end", [-(2**62)], np.int64), const("r_step", [-1], np.int64),
            const("r_axis0", [0], np.int64)]
    return (*flip, Node("Transpose", ("x",), ("x0",), {"perm": [1, 0, 2]}),
            Node("Slice", ("x0", "r_start", "r_end", "r_axis0", "r_step"), ("xt",)),
            Node("Scan", ("h0", "xt"), ("y", "ys"), {"body": body, "num_scan_inputs": 1}),
            Node("Slice", ("ys", "r_start", "r_end", "r_axis0", "r_step"), ("ysr",)),
            Node("Transpose", ("ysr",), ("y1",), {"perm": [1, 0, 2]}))


def _sequences_part_b() -> list[OpRow]:
    split = Node("SplitToSequence", ("x",), ("seq",), {"axis": 1})
    concat = Node("ConcatFromSequence", ("y",), ("z",), {"axis": 1})
    return [
        row("SequenceInsert", "front_then_concat", x(), c("pos", 0), node_inputs=("seq", "x", "pos"),
            before=(split,), after=(concat,), dynamic_batch=False),
        row("SequenceInsert", "append_then_concat", x(), node_inputs=("seq", "x"), before=(split,), after=(concat,),
            **FORWARD_ONLY),
        row("SequenceErase", "middle_then_concat", x(), c("pos", 1), node_inputs=("seq", "pos"),
            before=(split,), after=(concat,), **FORWARD_ONLY),
        row("SequenceEmpty", "then_insert", x(), node_inputs=(), attrs={"dtype": F32},
            after=(Node("SequenceInsert", ("y", "x"), ("s",)), Node("ConcatFromSequence", ("s",), ("z",), {"axis": 1})),
            **FORWARD_ONLY),
    ]


def _spectral() -> list[OpRow]:
    signal = x(shape=(2, 8, 1))
    complex_signal = x(shape=(2, 8, 2))
    # the oracle runs in float64 (CastLike); a constant needs no symbolic-batch check
    times_x = (Node("CastLike", ("y", "x"), ("yx",)), Node("Mul", ("yx", "x"), ("z",)))
    return [
        row("DFT", "real_axis1_opset17", signal, opset=17, **FORWARD_ONLY),
        row("DFT", "onesided_length10_opset17", signal, c("n", 10), opset=17, attrs={"onesided": 1}),
        row("DFT", "complex_inverse_opset20", complex_signal, absent(), c("axis", 1), opset=20, attrs={"inverse": 1}),
        row("DFT", "irfft_opset20", x(shape=(2, 5, 2)), absent(), c("axis", -2), opset=20,
            attrs={"inverse": 1, "onesided": 1}),
        row("DFT", "complex_axis2_truncated_opset20", x(shape=(2, 3, 6, 2)), c("n", 4), c("axis", 2), opset=20),
        row("HannWindow", "periodic_times_x", c("size", 4), x(), node_inputs=("size",), after=times_x, dynamic_batch=False),
        row("HammingWindow", "symmetric_double_times_x", c("size", 4), x(), node_inputs=("size",),
            attrs={"periodic": 0, "output_datatype": onnx.TensorProto.DOUBLE}, after=times_x, **FORWARD_ONLY),
        row("BlackmanWindow", "periodic_times_x", c("size", 4), x(), node_inputs=("size",), after=times_x, **FORWARD_ONLY),
    ]


def _quantization() -> list[OpRow]:
    dequantize = (Node("DequantizeLinear", ("y", "scale", "zp"), ("z",)),)
    per_axis = (Node("DequantizeLinear", ("y", "scale", "zp"), ("z",), {"axis": 1}),)
    # QDQ trains with a straight-through gradient, not finite differences: tests/test_quantize.py.
    qdq = dict(grad=False, dynamic_batch=False)
    return [
        row("QuantizeLinear", "uint8", x(), c("scale", 0.05, np.float32), c("zp", 128, np.uint8), out_dtype=np.uint8, **qdq),
        row("QuantizeLinear", "int8_per_axis", x(), c("scale", [0.02, 0.05, 0.1], np.float32), c("zp", [0, 3, -4], np.int8),
            attrs={"axis": 1}, out_dtype=np.int8, **qdq),
        row("QuantizeLinear", "qdq_uint8", x(), c("scale", 0.05, np.float32), c("zp", 128, np.uint8), after=dequantize, **qdq),
        row("QuantizeLinear", "qdq_int8_per_axis", x(), c("scale", [0.02, 0.05, 0.1], np.float32),
            c("zp", [0, 3, -4], np.int8), attrs={"axis": 1}, after=per_axis, **qdq),
        row("QuantizeLinear", "saturating_no_zero_point", x(), c("scale", 0.005, np.float32), out_dtype=np.uint8, **qdq),
        row("QuantizeLinear", "int8_blocked_opset21", x(), c("scale", np.full((2, 3, 2), 0.03), np.float32),
            c("zp", np.zeros((2, 3, 2)), np.int8), attrs={"axis": 2, "block_size": 2}, opset=21, out_dtype=np.int8, **qdq),
        row("DequantizeLinear", "uint8_per_tensor", x(values="int:255", dtype=np.uint8), c("scale", 0.05, np.float32),
            c("zp", 128, np.uint8), **qdq),
        row("DequantizeLinear", "int8_per_axis", x(values="int:100", dtype=np.int8), c("scale", [0.02, 0.05, 0.1], np.float32),
            c("zp", [0, 3, -4], np.int8), attrs={"axis": 1}, **qdq),
        row("DynamicQuantizeLinear", "then_dequantize", x(), outputs=3,
            after=(Node("DequantizeLinear", ("y", "y1", "y2"), ("z",)),), **qdq),
        row("MatMulInteger", "uint8_zero_points", x(values="int:255", dtype=np.uint8),
            c("b", np.random.default_rng(3).integers(0, 255, (4, 5)), np.uint8), c("azp", 3, np.uint8),
            c("bzp", 100, np.uint8), out_dtype=np.int32, **qdq),
        row("QLinearMatMul", "int8", x(values="int:100", dtype=np.int8), c("a_scale", 0.05, np.float32),
            c("a_zp", 2, np.int8), c("b", np.random.default_rng(4).integers(-100, 100, (4, 5)), np.int8),
            c("b_scale", 0.02, np.float32), c("b_zp", -1, np.int8), c("y_scale", 0.1, np.float32),
            c("y_zp", 5, np.int8), out_dtype=np.int8, **qdq),
    ]


def _nms() -> list[OpRow]:
    boxes = np.array([[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11], [0, 10.1, 1, 11.1],
                      [0, 100, 1, 101]], np.float32)
    nms = dict(grad=False, dynamic_batch=False, out_dtype=np.int64)
    return [
        row("NonMaxSuppression", "two_classes_score_threshold", Arg("boxes", value=np.stack([boxes, boxes[::-1]])),
            x(name="scores", shape=(2, 2, 6), values="distinct"), c("limit", 2), c("iou", 0.5, np.float32),
            c("score", 0.0, np.float32), **nms),
        row("NonMaxSuppression", "center_point_box", Arg("boxes", value=np.stack([boxes, boxes])),
            x(name="scores", shape=(2, 1, 6), values="distinct"), c("limit", 3), c("iou", 0.5, np.float32),
            attrs={"center_point_box": 1}, **nms),
    ]


def part_b_rows() -> list[OpRow]:
    """Issue 12 part B's rows."""
    return _control_flow() + _sequences_part_b() + _spectral() + _quantization() + _nms()


def all_rows() -> list[OpRow]:
    """Every row of the database, in a stable order."""
    return (_elementwise() + _activations() + _reductions() + _linear() + _conv() + _pool() + _normalization()
            + _dropout() + _tensor() + _resize() + _rnn() + _sequence() + _issue12a()
            + part_b_rows())


ROWS: list[OpRow] = all_rows()


# --- random ops (issue 15) ---
# Train-mode exports' random ops read a per-step noise input (bridge/pipeline/importer/ops/random.py). Each
# row floors the draw where its range is known (uniform in [3, 3.5), normal 10.5 +- 0.01 * 5.8 at
# most for float32 noise, Bernoulli of p in {0, 1}), so onnxruntime's own draws give the same
# forward; the training step (update, float32 vs float64, onnx-mlir) runs with drawn noise.

def _random_then_affine(op_type: str, variant: str, node_inputs: tuple[str, ...], attrs: dict) -> OpRow:
    """``x * w + CastLike(Floor(op(...)), x)``: the floored draw is fixed, so the forward is."""
    after = (Node("Floor", ("y",), ("f",)), Node("CastLike", ("f", "x"), ("fx",)), Node("Mul", ("x", "w"), ("xw",)),
             Node("Add", ("xw", "fx"), ("z",)))
    return row(op_type, variant, x(), w("w", (3, 4)), node_inputs=node_inputs, attrs=attrs, after=after)


def _random() -> list[OpRow]:
    bernoulli_after = (Node("Mul", ("x", "w"), ("xw",)), Node("Mul", ("xw", "y"), ("z",)))
    return [
        _random_then_affine("RandomUniformLike", "low_high", ("x",), {"low": 3.0, "high": 3.5}),
        _random_then_affine("RandomNormalLike", "mean_scale", ("x",), {"mean": 10.5, "scale": 0.01}),
        _random_then_affine("RandomUniform", "shape", (), {"shape": [3, 4], "low": 3.0, "high": 3.5}),
        _random_then_affine("RandomNormal", "shape", (), {"shape": [3, 4], "mean": 10.5, "scale": 0.01}),
        row("Bernoulli", "p_zero_one", x(), w("w", (3, 4)), x(name="p", values="int:2"), node_inputs=("p",), after=bernoulli_after, xfail_checks=("forward",),
            xfail="onnxruntime's Bernoulli draws 1 with probability 1 - p (ONNX's reference evaluator: p)"),
    ]


ROWS += _random()


# --- kinks and bounds (issue 33) ---
# Each row puts a trainable ``w`` at exactly the op's non-smooth points, where finite differences
# mean nothing: the gradient must equal torch's (``twin``), the convention bridge follows.

def kink(op_type: str, variant: str, at, twin: Callable[..., Any], *args: Arg, **options) -> OpRow:
    """``op(x + w, *args)`` with ``x = 0`` and ``w = at``; ``twin``: the torch op of ``x + w`` (and of
    the weights among ``args``, by name)."""
    at = np.asarray(at, np.float32)
    return row(op_type, f"kink_{variant}", Arg("x", role=DATA, value=np.zeros_like(at)), Arg("w", role=WEIGHT, value=at),
               *args, node_inputs=("s", *(a.name for a in args)), before=(Node("Add", ("x", "w"), ("s",)),),
               twin=lambda x, w, **weights: twin(x + w, **weights), dynamic_batch=False, **options)


def tie(op_type: str, variant: str, at, twin: Callable[..., Any], **options) -> OpRow:
    """``op(x + a, b)`` with ``x = 0`` and ``a = b = at``: a tie between two trainable inputs."""
    at = np.asarray(at, np.float32)
    return row(op_type, f"tie_{variant}", Arg("x", role=DATA, value=np.zeros_like(at)), Arg("a", role=WEIGHT, value=at),
               Arg("b", role=WEIGHT, value=at), node_inputs=("s", "b"), before=(Node("Add", ("x", "a"), ("s",)),),
               twin=lambda x, a, b: twin(x + a, b), dynamic_batch=False, **options)


def _qdq_kink(variant: str, at, scale, zero_point, twin: Callable[..., Any], **attrs) -> OpRow:
    """QuantizeLinear -> DequantizeLinear at the clamp bounds and rounding ties: torch's fake
    quantization, which runs in float32 only; its values and its 0/1 gradient mask are exact, so
    the twin carries them into float64 (the upstream gradient is not rounded to float32)."""
    def in_float64(t):
        t32 = t.detach().float().requires_grad_()
        value = twin(t32)
        (mask,) = torch.autograd.grad(value.sum(), t32)
        return value.detach().double() + mask.double() * (t - t.detach())

    consts = (c("scale", scale, np.float32), c("zp", zero_point, np.int8))
    after = (Node("DequantizeLinear", ("y", "scale", "zp"), ("z",), attrs),)
    return kink("QuantizeLinear", variant, at, in_float64, *consts, attrs=attrs, after=after, opset=19)


A01 = float(np.float32(0.1))
# Selu's default attributes as ONNX holds them (float32), so the twin computes the same function
SELU_ALPHA, SELU_GAMMA = float(np.float32(1.67326319217681884765625)), float(np.float32(1.05070102214813232421875))


def _kinks() -> list[OpRow]:
    at0 = [[0.0, 1.0, -1.0], [0.0, -0.0, 2.0]]
    integers, halves = [[0.0, 1.0, -2.0], [3.0, 0.5, 0.0]], [[0.5, 1.5, -0.5], [2.5, 0.0, -1.5]]
    ties = [[[[1.0, 1.0, 0.5, -2.0], [1.0, 1.0, -2.0, -2.0], [0.0, 0.0, 0.0, 3.0], [0.0, -1.0, 3.0, 3.0]]]]
    zero_slice = [[0.0, 0.0, 0.0], [3.0, 0.0, -4.0]]
    return [
        kink("Relu", "0", at0, F.relu),
        kink("LeakyRelu", "0", at0, lambda t: F.leaky_relu(t, A01), attrs={"alpha": A01}),
        kink("PRelu", "0", at0, lambda t, slope: F.prelu(t, slope), Arg("slope", role=WEIGHT, value=np.float32([0.25]))),
        kink("Elu", "0", at0, F.elu),
        kink("Elu", "alpha2_0", at0, lambda t: F.elu(t, 2.0), attrs={"alpha": 2.0}),
        kink("Selu", "0", at0, lambda t: SELU_GAMMA * F.elu(t, SELU_ALPHA)),
        kink("Celu", "alpha2_0", at0, lambda t: F.celu(t, 2.0), attrs={"alpha": 2.0}),
        kink("ThresholdedRelu", "alpha", [[1.0, 2.0, 0.0]], lambda t: F.threshold(t, 1.0, 0.0)),
        # clamp-like twins are F.hardtanh: 0 at a bound in every torch (torch.clamp with number bounds passes
        # the gradient there up to torch 2.13, not from 2.14)
        kink("HardSigmoid", "bounds", [[-2.0, 2.0, 0.0]], lambda t: F.hardtanh(0.25 * t + 0.5, 0.0, 1.0),
             attrs={"alpha": 0.25, "beta": 0.5}),
        kink("HardSwish", "bounds", [[-3.0, 3.0, 0.0]], F.hardswish),
        kink("Shrink", "lambd", [[0.5, -0.5, 0.0]], lambda t: F.softshrink(t, 0.5), attrs={"lambd": 0.5, "bias": 0.5}),
        kink("Abs", "0", at0, torch.abs),
        kink("Sign", "0", at0, torch.sign),
        kink("Floor", "integers", integers, torch.floor),
        kink("Ceil", "integers", integers, torch.ceil),
        kink("Round", "halves", halves, torch.round),
        kink("Clip", "at_bounds", [[-0.5, 0.75, 0.0], [-1.0, 1.0, 0.75]], lambda t: F.hardtanh(t, -0.5, 0.75),
             c("lo", -0.5, np.float32), c("hi", 0.75, np.float32)),
        kink("Clip", "at_min_only", [[-0.5, 0.75, -1.0]], lambda t: F.hardtanh(t, -0.5, math.inf), c("lo", -0.5, np.float32)),
        tie("Max", "two", at0, torch.maximum),
        tie("Min", "two", at0, torch.minimum),
        kink("ReduceMax", "ties", ties[0][0], lambda t: torch.amax(t, dim=1, keepdim=True), c("axes", [1])),
        kink("ReduceMin", "ties", ties[0][0], lambda t: torch.amin(t, dim=0, keepdim=True), c("axes", [0])),
        kink("MaxPool", "ties_k2s2", ties, lambda t: F.max_pool2d(t, 2, 2), attrs={"kernel_shape": [2, 2], "strides": [2, 2]}),
        kink("MaxPool", "ties_k3_pads", ties, lambda t: F.max_pool2d(t, 3, 1, 1),
             attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
        kink("GlobalMaxPool", "ties", ties, lambda t: F.adaptive_max_pool2d(t, 1)),
        kink("LpNormalization", "p2_zero_slice", zero_slice, lambda t: F.normalize(t, 2.0, -1)),
        kink("LpNormalization", "p1_zero_slice", zero_slice, lambda t: F.normalize(t, 1.0, -1), attrs={"p": 1}),
        kink("LpNormalization", "axis0_zero_slice", np.transpose(zero_slice), lambda t: F.normalize(t, 2.0, 0),
             attrs={"axis": 0}),
        kink("ReduceL2", "zero_slice", zero_slice, lambda t: torch.linalg.vector_norm(t, 2, -1, keepdim=True),
             c("axes", [-1])),
        kink("GlobalLpPool", "p2_zero_plane", [[[[0.0, 0.0], [0.0, 0.0]], [[3.0, 0.0], [0.0, -4.0]]]],
             lambda t: F.lp_pool2d(t, 2.0, t.shape[2:]),
             oracle=(const("axes", [2, 3], np.int64), Node("ReduceL2", ("s", "axes"), ("y",)))),
        kink("ReduceL1", "zero_slice", zero_slice, lambda t: torch.linalg.vector_norm(t, 1, -1, keepdim=True),
             c("axes", [-1])),
        # codes 127 and -128 exactly (pass), 127.5 -> 128 and -128.5 -> -128 (round half to even), beyond
        _qdq_kink("per_tensor_bounds", [[63.5, -64.0, 63.75, -64.25], [64.5, -65.0, 0.25, 0.75]], 0.5, 0,
                  lambda t: torch.fake_quantize_per_tensor_affine(t, 0.5, 0, -128, 127)),
        _qdq_kink("per_channel_bounds", [[127.0, -128.0, 127.5, 126.5], [63.5, -64.0, 63.75, -64.5]], [1.0, 0.5], [0, 0],
                  lambda t: torch.fake_quantize_per_channel_affine(t, torch.tensor([1.0, 0.5]), torch.zeros(2, dtype=torch.int32),
                                                                   0, -128, 127), axis=0),
    ]


ROWS += _kinks()


ML = "ai.onnx.ml::"
CLASSES = 3


def _linear_classifier(variant: str, post_transform: str, oracle_post: tuple[Node, ...], rows: int = CLASSES,
                       **options) -> OpRow:
    """LinearClassifier over 3 features, ``rows`` coefficient rows (one row: a binary model, scores ``[-s, s]``),
    its scores as the model output. The oracle computes the scores with standard ops from the coefficients
    as initializers (``s``), then ``oracle_post`` makes ``y1`` from them."""
    rng = np.random.default_rng(zlib.crc32(variant.encode()))
    attrs = {"coefficients": rng.uniform(-1, 1, rows * 3).tolist(), "intercepts": rng.uniform(-0.5, 0.5, rows).tolist(),
             "classlabels_ints": list(range(max(rows, 2))), "post_transform": post_transform}
    oracle = (const("rows_by_features", [rows, -1], np.int64),
              Node("Reshape", ("node.coefficients", "rows_by_features"), ("matrix",)),
              Node("Transpose", ("matrix",), ("per_feature",)), Node("MatMul", ("x", "per_feature"), ("xw",)),
              Node("Add", ("xw", "node.intercepts"), ("s",)), *oracle_post)
    return row(f"{ML}LinearClassifier", variant, x((BATCH, 3)), attrs=attrs, outputs=2,
               after=(Node("Identity", ("y1",), ("scores",)),), oracle=oracle,
               attribute_weights=("coefficients", "intercepts"), **options)


def _ml() -> list[OpRow]:
    softmax = (Node("Softmax", ("s",), ("y1",), {"axis": 1}),)
    binary = (Node("Neg", ("s",), ("minus",)), Node("Concat", ("minus", "s"), ("both",), {"axis": 1}),
              Node("Sigmoid", ("both",), ("y1",)))
    # the norms of a row, as standard ops over axis 1 (opset 18: axes as an input)
    norms = {"MAX": (Node("ReduceMax", ("x", "axes"), ("n",), {"keepdims": 1}),),
             "L1": (Node("ReduceL1", ("x", "axes"), ("n",), {"keepdims": 1}),),
             "L2": (Node("ReduceL2", ("x", "axes"), ("n",), {"keepdims": 1}),)}
    return [
        _linear_classifier("softmax", "SOFTMAX", softmax),
        _linear_classifier("logistic", "LOGISTIC", (Node("Sigmoid", ("s",), ("y1",)),)),
        _linear_classifier("none", "NONE", (Node("Identity", ("s",), ("y1",)),)),
        # no score within 1e-7 of 0 here: SOFTMAX_ZERO is the softmax
        _linear_classifier("softmax_zero", "SOFTMAX_ZERO", softmax),
        _linear_classifier("binary_logistic", "LOGISTIC", binary, rows=1),
        *[row(f"{ML}Normalizer", norm.lower(), x((BATCH, 5), values="distinct"), attrs={"norm": norm},
              oracle=(const("axes", [1], np.int64), *nodes, Node("Div", ("x", "n"), ("y",))))
          for norm, nodes in norms.items()],
        row(f"{ML}ZipMap", "int64_labels", x((BATCH, CLASSES), values="positive"),
            attrs={"classlabels_int64s": list(range(CLASSES))}, out_dtype=MAP_OUTPUT,
            oracle=(Node("Identity", ("x",), ("y",)),)),
    ]


ROWS += _ml()
