"""The ONNX graph under construction and the emitter registry.

Emitters turn one ATen op into standard ONNX nodes::

    @emits(aten.mm.default)
    def mm(b: GraphBuilder, node, a, other):
        return b.op("MatMul", a, other)

Tensor arguments arrive as ``Value``s (ONNX value names that also carry the traced
``shape`` and ``dtype``); other arguments arrive as given to the ATen op. An emitter returns
a ``Value`` (or a tuple for multi-output ops). ``b.op`` stamps every node with the phase and
layer of the FX node being emitted.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import onnx
import sympy
import torch
from onnx import TensorProto, helper

from ..errors import ShapeError
from ..load import STUB_BYTES, STUB_FILE, raw_bytes

TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}

TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


class Value(str):
    """An ONNX value name with the traced shape and dtype (``None`` when not known)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    is_size: bool = False  # a 1-element int64 value holding a symbolic size

    def __new__(cls, name: str, shape=None, dtype=None):
        value = super().__new__(cls, name)
        value.shape = None if shape is None else tuple(d if isinstance(d, torch.SymInt) else int(d) for d in shape)
        value.dtype = dtype
        return value

    @property
    def rank(self) -> int:
        return len(self.shape)


EMITTERS: dict[Any, Callable] = {}


def emits(*targets):
    """Register ``fn`` as the ONNX emitter of each ATen overload (or callable) in ``targets``."""

    def register(fn):
        for target in targets:
            EMITTERS[target] = fn
        return fn

    return register


def node_prefix(tags: dict[str, str]) -> str:
    """``<phase>_<kind>/<layer>/``: the start of the name of a node with these tags."""
    phase, kind = tags.get("bridge.phase", ""), tags.get("bridge.kind", "")
    layer = tags.get("bridge.layer", "").lstrip("/")
    prefix = f"{phase}_{kind}" if kind else phase
    return f"{prefix}/{layer}/" if layer else f"{prefix}/"


class GraphBuilder:
    """Collects nodes and initializers; names and annotates every node it creates."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[tuple[str, np.ndarray]] = []  # written by write_initializers
        self._const_cache: dict[tuple, Value] = {}
        self._names: set[str] = set()
        self.tags: dict[str, str] = {}
        self.value_hint = "v"
        self._symbol_sources: dict = {}
        self._symbol_values: dict = {}

    def fresh(self, hint: str) -> str:
        name, k = hint, 0
        while name in self._names:
            k += 1
            name = f"{hint}_{k}"
        self._names.add(name)
        return name

    def reserve(self, name: str) -> None:
        self._names.add(name)

    def op(
        self,
        op_type: str,
        *inputs: str | None,
        outputs: int = 1,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        **attrs,
    ) -> Value | tuple[Value, ...]:
        """Add one ONNX node; returns its output value(s)."""
        names = [Value(self.fresh(self.value_hint), shape, dtype) for _ in range(outputs)]
        node = helper.make_node(
            op_type,
            ["" if i is None else str(i) for i in inputs],
            [str(n) for n in names],
            name=self.fresh(node_prefix(self.tags) + op_type),
            **{k: v for k, v in attrs.items() if v is not None},
        )
        for key, value in self.tags.items():
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
        self.nodes.append(node)
        return names[0] if outputs == 1 else tuple(names)

    def const(self, value, dtype: torch.dtype | None = None, name: str | None = None) -> Value:
        """A constant tensor (an initializer), shared between uses of equal small constants."""
        array = np.asarray(value, dtype=TORCH_TO_NUMPY[dtype] if dtype is not None else None)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 16 and name is None else None
        if key is not None and key in self._const_cache:
            return self._const_cache[key]
        torch_dtype = next((t for t, n in TORCH_TO_NUMPY.items() if np.dtype(n) == array.dtype), None)
        result = Value(self.fresh(name or "const"), array.shape, torch_dtype)
        self.initializers.append((str(result), array))
        if key is not None:
            self._const_cache[key] = result
        return result

    def write_initializers(self, graph: onnx.GraphProto, stubs: dict[str, np.ndarray] | None = None) -> None:
        """Add the constants to ``graph`` in place, one at a time: each tensor's bytes are copied once
        into the graph (``make_graph``'s ``extend`` and ``make_model``'s ``CopyFrom`` would copy every
        tensor twice more, and protobuf cannot copy a tensor over 2 GiB that way at all; such a folded
        constant is then saved with external data like any weight past the threshold). With ``stubs``,
        a constant over ``STUB_BYTES`` is added as a data-less external-data stub and its array put in
        ``stubs`` instead (a graph exported to be written, ``training_model.write_model``)."""
        for name, array in self.initializers:
            tensor = graph.initializer.add(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                                           dims=array.shape)
            if stubs is not None and array.nbytes > STUB_BYTES:
                tensor.data_location = TensorProto.EXTERNAL
                tensor.external_data.add(key="location", value=STUB_FILE)
                stubs[name] = array
                continue
            tensor.raw_data = raw_bytes(array)
        self.initializers = []

    def ints(self, values: Sequence[int]) -> Value:
        """A 1-D int64 constant (shapes, axes, pads)."""
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar(self, value, dtype: torch.dtype) -> Value:
        """A 0-d constant of ``dtype``."""
        return self.const(np.asarray(value, dtype=TORCH_TO_NUMPY[dtype]))

    # -- helpers shared by emitters ---------------------------------------------------------

    def cast(self, x: Value, dtype: torch.dtype) -> Value:
        """``x`` as ``dtype`` (no node when it already is)."""
        if x.dtype == dtype:
            return x
        if x.dtype == torch.bool and dtype.is_floating_point:
            # Where instead of Cast: onnx-mlir casts only between float types.
            return self.op("Where", x, self.scalar(1, dtype), self.scalar(0, dtype), shape=x.shape, dtype=dtype)
        return self.op("Cast", x, to=TORCH_TO_ONNX[dtype], shape=x.shape, dtype=dtype)

    def operand(self, x, dtype: torch.dtype) -> Value:
        """A tensor, Python scalar or symbolic size operand, as a value of ``dtype``."""
        if isinstance(x, (torch.SymInt, torch.SymFloat)) or (isinstance(x, Value) and x.is_size):
            return self.size_scalar(x, dtype)
        if isinstance(x, Value):
            return self.cast(x, dtype)
        return self.scalar(x, dtype)

    def size_scalar(self, size, dtype: torch.dtype) -> Value:
        """A symbolic size as a 0-d value of ``dtype``.

        A float copy of a size is made as ReduceSum(Expand(1, [size])), not Cast(int64 -> float):
        onnx-mlir casts only between float types. Exact up to 2**24 in float32.
        """
        if isinstance(size, torch.SymFloat):
            size = size.node.expr.args[0] if type(size.node.expr).__name__ == "ToFloat" else size
            size = self._expr(size) if not isinstance(size, torch.SymInt) else self.dim(size)
        length = self.dim(size)
        if dtype.is_floating_point:
            ones = self.op("Expand", self.scalar(1, dtype), length, dtype=dtype)
            total = self.op("ReduceSum", ones, self.ints([0]), keepdims=1, shape=[1], dtype=dtype)
            return self.reshape(total, [])
        return self.reshape(self.cast(length, dtype), [])

    def reshape(self, x: Value, shape: Sequence) -> Value:
        if is_static(shape) and x.shape is not None and is_static(x.shape) and tuple(x.shape) == tuple(shape):
            return x
        return self.op("Reshape", x, self.shape_tensor(shape), shape=shape if is_static(shape) else None, dtype=x.dtype)

    # -- symbolic sizes (dynamic batch) -------------------------------------------------------

    def add_symbol_source(self, size, value: Value, axis: int) -> None:
        """Record that the symbolic ``size`` (a SymInt) is dim ``axis`` of graph input ``value``."""
        symbol = size.node.expr
        if isinstance(symbol, sympy.Symbol) and symbol not in self._symbol_sources:
            self._symbol_sources[symbol] = (value, axis)

    def dim(self, size) -> Value:
        """A size (int, SymInt, or an already emitted 1-element value) as a 1-D int64 [1] value."""
        if isinstance(size, Value):
            return size
        if not isinstance(size, torch.SymInt):
            return self.ints([int(size)])
        return self._expr(size.node.expr)

    def _expr(self, expr) -> Value:
        if expr in self._symbol_values:
            return self._symbol_values[expr]
        if expr.is_Integer:
            return self.ints([int(expr)])
        if isinstance(expr, sympy.Symbol):
            if expr not in self._symbol_sources:
                raise ShapeError(f"symbolic size {expr} does not come from a graph input")
            source, axis = self._symbol_sources[expr]
            # Shape(x)[axis:axis+1] with Slice: onnx-mlir's Shape has no start/end attributes.
            full = self.op("Shape", source, shape=[len(source.shape)], dtype=torch.int64)
            result = self.op("Slice", full, self.ints([axis]), self.ints([axis + 1]), self.ints([0]), shape=[1], dtype=torch.int64)
        elif expr.is_Add or expr.is_Mul:
            terms = [self._expr(arg) for arg in expr.args]
            result = terms[0]
            for term in terms[1:]:
                result = self.op("Add" if expr.is_Add else "Mul", result, term, shape=[1], dtype=torch.int64)
        elif type(expr).__name__ == "FloorDiv":
            numerator, denominator = (self._expr(arg) for arg in expr.args)
            result = self.op("Div", numerator, denominator, shape=[1], dtype=torch.int64)
        else:
            raise ShapeError(f"bridge cannot express the symbolic size {expr} in ONNX")
        result.is_size = True
        self._symbol_values[expr] = result
        return result

    def shape_tensor(self, sizes: Sequence) -> Value:
        """A 1-D int64 value holding ``sizes`` (ints, SymInts or 1-element values)."""
        if is_static(sizes):
            return self.ints([int(d) for d in sizes])
        parts, run = [], []
        for size in sizes:
            if isinstance(size, (torch.SymInt, Value)):
                if run:
                    parts.append(self.ints(run))
                    run = []
                parts.append(self.dim(size))
            else:
                run.append(int(size))
        if run:
            parts.append(self.ints(run))
        return parts[0] if len(parts) == 1 else self.op("Concat", *parts, axis=0, shape=[len(sizes)], dtype=torch.int64)


def is_static(sizes) -> bool:
    """True when every size is a plain int (no SymInt, no emitted value)."""
    return all(not isinstance(d, (torch.SymInt, Value)) for d in sizes)
