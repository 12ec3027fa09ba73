"""The ONNX graph under construction and the emitter registry.

Emitters turn one ATen op into standard ONNX nodes::

    @emits(aten.mm.default)
    def mm(b: GraphBuilder, node, a, other):
        return b.op("MatMul", a, other)

Tensor arguments arrive as ``Value``s (ONNX value names that also carry the traced
``shape`` and ``dtype``); other arguments arrive as given to the ATen op. An emitter returns
a ``Value`` (or a tuple for multi-output ops). ``b.op`` stamps every node with the phase and
layer of the FX node being emitted: the exporter runs each emitter inside
``b.node_context(tags, hint)``, which sets ``b.context`` (an ``EmitContext``) and restores it after.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx
import sympy
import torch
from onnx import StringStringEntryProto, TensorProto, helper

from ...contract import node_prefix
from ...dtypes import NUMPY_TO_TORCH, TORCH_TO_NUMPY, TORCH_TO_ONNX  # noqa: F401 (TORCH_TO_ONNX: re-exported)
from ...errors import ShapeError
from ...onnx_file import STUB_BYTES, STUB_FILE, raw_bytes
from ..registry import import_submodules, registering


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


class EmitterFn(Protocol):
    """An emitter: the builder, the FX node and the ATen op's arguments (FX nodes replaced by their
    ``Value``) -> the ``Value`` (or tuple of them) of the op's result, built with ``b.op``. It
    raises only ``bridge.errors.LoweringError`` (naming ``node``) for a form it cannot emit."""

    def __call__(self, b: GraphBuilder, node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any: ...


EMITTERS: dict[Any, EmitterFn] = {}


def emits(*targets):
    """Register ``fn`` as the ONNX emitter of each ATen overload (or callable) in ``targets`` (once per target)."""
    return registering(EMITTERS, targets, "emitters for")


def import_all_emitters() -> None:
    """Import every module of ``bridge.pipeline.export.ops`` so that their emitters register."""
    import_submodules(f"{__package__}.ops")


@dataclass(frozen=True)
class EmitContext:
    """What ``GraphBuilder`` stamps on the nodes it creates for one FX node: its ``tags``
    (``bridge.phase``, ``bridge.layer``, ``bridge.kind``; empty ones left out) and the ``hint``
    that the names of new values start with (the FX node's name)."""

    tags: Mapping[str, str] = field(default_factory=dict)
    hint: str = "v"

    @functools.cached_property
    def prefix(self) -> str:
        """The start of the name of each node made in this context (``node_prefix`` of its tags)."""
        return node_prefix(self.tags)

    @functools.cached_property
    def entries(self) -> list[StringStringEntryProto]:
        """The tags as the ``metadata_props`` entries each node made in this context gets a copy of."""
        return [StringStringEntryProto(key=key, value=value) for key, value in self.tags.items()]


class GraphBuilder:
    """Collects nodes and initializers; names and annotates every node it creates."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[tuple[str, np.ndarray]] = []  # written by write_initializers
        self._const_cache: dict[tuple, Value] = {}
        self._folded: dict[str, np.ndarray] = {}  # an unnamed constant's value -> its array (reshapes fold into it)
        self._names: set[str] = set()
        self._next_suffix: dict[str, int] = {}  # hint -> the first suffix ``fresh`` has not tried for it
        self.context = EmitContext()
        self._symbol_sources: dict = {}
        self._symbol_values: dict = {}
        self._swapped: dict[str, Value] = {}  # a 2-D Transpose's output -> its input
        self._reshaped: dict[str, Value] = {}  # a static Reshape's output -> its input

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        """``x`` transposed by ``perm`` (``x`` itself for the identity). A 2-D swap is remembered so that a
        product reading it can read ``x`` instead (``matrix``), and a swap of a swap is its source."""
        perm = list(perm)
        if perm == list(range(len(perm))):
            return x
        if perm != [1, 0]:
            return self.op("Transpose", x, perm=perm)
        if str(x) in self._swapped:
            return self._swapped[str(x)]
        y = self.op("Transpose", x, perm=perm, shape=None if x.shape is None else list(x.shape)[::-1], dtype=x.dtype)
        self._swapped[str(y)] = x
        return y

    def matrix(self, x: Value) -> tuple[Value, int]:
        """``(source, 1)`` when ``x`` is ``transpose(source, [1, 0])``, else ``(x, 0)``: a Gemm operand and its
        ``transA``/``transB`` flag, so that no Transpose is run for it."""
        source = self._swapped.get(str(x))
        return (x, 0) if source is None else (source, 1)

    def fresh(self, hint: str) -> str:
        """``hint``, or ``hint_<k>`` for the first ``k`` whose name is free; names are never freed, so the search
        for a hint resumes after the suffix it last gave (thousands of ``const`` values in a large graph)."""
        k = self._next_suffix.get(hint, 0)
        name = f"{hint}_{k}" if k else hint
        while name in self._names:
            k += 1
            name = f"{hint}_{k}"
        self._names.add(name)
        self._next_suffix[hint] = k + 1
        return name

    def reserve(self, name: str) -> None:
        self._names.add(name)

    @contextlib.contextmanager
    def node_context(self, tags: Mapping[str, str], hint: str) -> Iterator[EmitContext]:
        """Nodes created inside carry ``tags`` and values are named after ``hint``; the previous
        context is restored on exit."""
        outer, self.context = self.context, EmitContext(dict(tags), hint)
        try:
            yield self.context
        finally:
            self.context = outer

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
        names = [Value(self.fresh(self.context.hint), shape, dtype) for _ in range(outputs)]
        node = helper.make_node(
            op_type,
            ["" if i is None else str(i) for i in inputs],
            [str(n) for n in names],
            name=self.fresh(self.context.prefix + op_type),
            **{k: v for k, v in attrs.items() if v is not None},
        )
        node.metadata_props.extend(self.context.entries)
        self.nodes.append(node)
        return names[0] if outputs == 1 else tuple(names)

    def const(self, value, dtype: torch.dtype | None = None, name: str | None = None) -> Value:
        """A constant tensor (an initializer), shared between uses of equal small constants."""
        array = np.asarray(value, dtype=TORCH_TO_NUMPY[dtype] if dtype is not None else None)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 16 and name is None else None
        if key is not None and key in self._const_cache:
            return self._const_cache[key]
        torch_dtype = NUMPY_TO_TORCH.get(array.dtype)
        result = Value(self.fresh(name or "const"), array.shape, torch_dtype)
        self.initializers.append((str(result), array))
        if name is None:
            self._folded[result] = array
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
        """``x`` as ``shape``: no node where ``x`` has it, a reshape of a static reshape reshapes its source
        (``[1, C, 1, 1]`` to ``[C]`` and back is the source itself), and a constant's is a new constant."""
        if not is_static(shape):
            return self.op("Reshape", x, self.shape_tensor(shape), dtype=x.dtype)
        x = self._reshaped.get(x, x)
        if x.shape is not None and is_static(x.shape) and tuple(x.shape) == tuple(shape):
            return x
        if x in self._folded:
            return self.const(self._folded[x].reshape([int(size) for size in shape]))
        y = self.op("Reshape", x, self.shape_tensor(shape), shape=shape, dtype=x.dtype)
        if x.shape is not None and is_static(x.shape):
            self._reshaped[y] = x
        return y

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
