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
import torch
from onnx import TensorProto, helper, numpy_helper

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

    def __new__(cls, name: str, shape=None, dtype=None):
        value = super().__new__(cls, name)
        value.shape = None if shape is None else tuple(int(d) for d in shape)
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


class GraphBuilder:
    """Collects nodes and initializers; names and annotates every node it creates."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._const_cache: dict[tuple, Value] = {}
        self._names: set[str] = set()
        self.tags: dict[str, str] = {}
        self.value_hint = "v"

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
            name=self.fresh(self._node_prefix() + op_type),
            **{k: v for k, v in attrs.items() if v is not None},
        )
        for key, value in self.tags.items():
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
        self.nodes.append(node)
        return names[0] if outputs == 1 else tuple(names)

    def _node_prefix(self) -> str:
        phase = self.tags.get("bridge.phase", "")
        kind = self.tags.get("bridge.kind", "")
        layer = self.tags.get("bridge.layer", "")
        prefix = f"{phase}_{kind}" if kind else phase
        return f"{prefix}/{layer}/" if layer else f"{prefix}/"

    def const(self, value, dtype: torch.dtype | None = None, name: str | None = None) -> Value:
        """A constant tensor (an initializer), shared between uses of equal small constants."""
        array = np.asarray(value, dtype=TORCH_TO_NUMPY[dtype] if dtype is not None else None)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 16 and name is None else None
        if key is not None and key in self._const_cache:
            return self._const_cache[key]
        torch_dtype = next((t for t, n in TORCH_TO_NUMPY.items() if np.dtype(n) == array.dtype), None)
        result = Value(self.fresh(name or "const"), array.shape, torch_dtype)
        self.initializers.append(numpy_helper.from_array(array, str(result)))
        if key is not None:
            self._const_cache[key] = result
        return result

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
        """A tensor or Python scalar operand, as a value of ``dtype``."""
        if isinstance(x, Value):
            return self.cast(x, dtype)
        return self.scalar(x, dtype)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        if x.shape is not None and tuple(x.shape) == tuple(shape):
            return x
        return self.op("Reshape", x, self.ints(shape), shape=shape, dtype=x.dtype)
