"""Seeded random weights for a wild file whose own weights the oracle cannot judge.

onnx's ``light`` test models keep their graphs but not their weights: every weight is a
``ConstantOfShape`` fill of 0.02, so activations grow to 1e10 or a softmax saturates and finite
differences measure nothing. The gradient of the graph does not depend on the weight values, so
the tier checks such a file with fresh weights, the same for bridge and the oracle: every float
initializer and every float fill of an initializer shape is drawn anew from ``seed``, the fills
becoming initializers of the same name, shape and type (a fill holds one value). A weight that a
node multiplies with its input (a Conv kernel, a Gemm or MatMul matrix) is He-normal,
``N(0, 2 / fan_in)``, so ReLU networks keep activations of order one; a one-element-per-channel
factor (a BatchNormalization scale or variance, a Mul operand) is uniform in [0.5, 1.5], so
variances stay positive; any other tensor (biases, means) is ``N(0, 0.1^2)``. Every other node,
the data inputs, the outputs and every tensor's shape are kept."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper
from wild.oracle import FLOAT32_ONLY_INPUTS, FLOATS

FAN_IN_NORMAL = "fan_in_normal"
# (op, input index) of the per-channel factors drawn in [0.5, 1.5].
FACTORS = {("BatchNormalization", 1), ("BatchNormalization", 4), ("InstanceNormalization", 1),
           ("LayerNormalization", 1), ("Mul", 0), ("Mul", 1)}
BIAS_STD = 0.1


def _attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _fan_in(node: onnx.NodeProto, index: int, shape: tuple[int, ...]) -> int | None:
    """The number of inputs each output of ``node`` sums over through its input ``index`` of
    ``shape``, or None where the input is not multiplied with the node's data."""
    if node.op_type in ("Conv", "ConvTranspose") and index == 1:
        return int(np.prod(shape[1:]))
    if node.op_type == "Gemm" and index == 1:
        return shape[1] if _attribute(node, "transB", 0) else shape[0]
    if node.op_type == "MatMul" and index == 1 and len(shape) >= 2:
        return shape[-2]
    return None


def _readers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, index))
    return readers


def _fills(graph: onnx.GraphProto) -> dict[str, tuple[str, list[int], int]]:
    """The float ``ConstantOfShape`` nodes whose shape is an int64 initializer: output name ->
    (shape initializer's name, shape, element type)."""
    shapes = {t.name: t for t in graph.initializer if t.data_type == onnx.TensorProto.INT64}
    fills = {}
    for node in graph.node:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if node.op_type == "ConstantOfShape" and node.input and node.input[0] in shapes and value is not None \
                and value.data_type in FLOATS:
            dims = [int(d) for d in numpy_helper.to_array(shapes[node.input[0]]).reshape(-1)]
            fills[node.output[0]] = (node.input[0], dims, value.data_type)
    return fills


def _draw(rng: np.random.Generator, shape: tuple[int, ...], readers: list[tuple[onnx.NodeProto, int]]) -> np.ndarray:
    fan_in = next((f for node, index in readers if (f := _fan_in(node, index, shape))), None)
    if fan_in:
        return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
    if any((node.op_type, index) in FACTORS for node, index in readers):
        return rng.uniform(0.5, 1.5, shape)
    return rng.standard_normal(shape) * BIAS_STD


def reinitialized(model: onnx.ModelProto, options: Mapping[str, object]) -> onnx.ModelProto:
    """A copy of ``model`` with every float weight drawn anew as the manifest's ``weights`` option
    says (``{"reinit": "fan_in_normal", "seed": 0}``); fills become initializers (and graph
    inputs where the file lists its initializers as inputs, as IR version 3 requires)."""
    if options.get("reinit") != FAN_IN_NORMAL or set(options) != {"reinit", "seed"}:
        raise ValueError(f"weights option {dict(options)!r}: the tier knows {{'reinit': {FAN_IN_NORMAL!r}, 'seed': N}}")
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    rng = np.random.default_rng(int(options["seed"]))  # type: ignore[call-overload]
    readers = _readers(graph)
    kept_float32 = {node.input[i] for node in graph.node for i in FLOAT32_ONLY_INPUTS.get(node.op_type, ())
                    if i < len(node.input)}
    listed = {i.name for i in graph.input}
    initializers_are_inputs = bool(graph.initializer) and all(t.name in listed for t in graph.initializer)
    fills = _fills(graph)
    for name, (_, dims, elem) in fills.items():
        graph.initializer.append(numpy_helper.from_array(np.zeros(dims, helper.tensor_dtype_to_np_dtype(elem)), name))
        if initializers_are_inputs:
            graph.input.append(helper.make_tensor_value_info(name, elem, dims))
    remaining = [n for n in graph.node if n.op_type != "ConstantOfShape" or n.output[0] not in fills]
    del graph.node[:]
    graph.node.extend(remaining)
    still_read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    unread_shapes = {shape for shape, _, _ in fills.values()} - still_read
    _drop(graph, unread_shapes)
    for tensor in graph.initializer:
        if tensor.data_type in FLOATS and tensor.name not in kept_float32:
            shape = tuple(tensor.dims)
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            tensor.CopyFrom(numpy_helper.from_array(_draw(rng, shape, readers.get(tensor.name, [])).astype(dtype),
                                                    tensor.name))
    return model


def _drop(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers ``names`` and their graph-input entries."""
    kept = [t for t in graph.initializer if t.name not in names]
    inputs = [i for i in graph.input if i.name not in names]
    del graph.initializer[:], graph.input[:]
    graph.initializer.extend(kept)
    graph.input.extend(inputs)
