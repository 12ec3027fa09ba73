"""Stage 2, import: run an ONNX graph as a torch function.

``OnnxProgram`` interprets the ONNX graph node by node with the converters of
``bridge.pipeline.importer.ops``. Unlike a module-per-node converter it keeps the ONNX names:
weights are passed in by their ORIGINAL initializer names, a shared initializer is one
tensor (so tied weights get one gradient), and every traced op can be tagged with the ONNX
node it comes from.

Values that are known at import time (initializers that are not passed as tensors,
``Constant`` outputs, shapes of tensors with static shapes, and anything computed only from
those) are kept as numpy arrays and folded eagerly, so shape computations never reach the
traced graph and converters can read shapes, axes, pads and scales as plain numbers.

A Relu read only by a MaxPool runs after it (``relus_pooled_first``) where the target uses the
``relu_after_maxpool`` form (bridge/pipeline/targets.py): the same values and gradients on the smaller,
pooled tensor.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterable, MutableMapping

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ...errors import BridgeWarning, ShapeError, UnsupportedOpError
from ...onnx_file import all_nodes, node_reads, skeleton
from .. import targets
from ..load import ML_OPS_HINT, default_opset
from ..replay import BlockLayouts, BlockReplay, Unkeyable
from .blocks import Segment, repeated_segments
from .registry import CONVERTERS, NodeContext, import_all_converters, op_key
from .shape_folding import fold_symbolic, folds_symbolic, is_symbolic

NodeScope = Callable[[onnx.NodeProto], contextlib.AbstractContextManager]

# torch has few kernels for uint16/32/64: such values are computed as int64 (exact for values
# below 2**63; additions and multiplications wrap like uint64 in two's complement) and the graph
# outputs of those types are cast back at the end. uint8 has torch kernels and is kept.
WIDE_UNSIGNED = {np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)}
_WIDE_UNSIGNED_TORCH = {torch.uint16, torch.uint32, torch.uint64}

# Ops whose output must never be folded at import time.
_NOT_FOLDABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Dropout"}


def importable(node: onnx.NodeProto) -> bool:
    """Whether bridge has a converter for ``node`` (its subgraphs not looked at)."""
    return op_key(node.domain, node.op_type) in CONVERTERS


class DroppedOutputsWarning(BridgeWarning):
    """Model outputs that the loss does not use and bridge cannot compute were left out."""


def _cone(graph: onnx.GraphProto, outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """The top-level nodes that ``outputs`` depend on, in graph order."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    needed: set[int] = set()
    pending = [producer[name] for name in outputs if name in producer]
    while pending:
        index = pending.pop()
        if index not in needed:
            needed.add(index)
            pending.extend(producer[name] for name in node_reads(graph.node[index]) if name in producer)
    return [graph.node[index] for index in sorted(needed)]


def drop_unimportable_outputs(model: onnx.ModelProto, keep: Iterable[str]) -> list[str]:
    """Remove, in place, the graph outputs not in ``keep`` that bridge cannot compute (an op without a
    converter on their path, or not a tensor: skl2onnx's ``label`` through ai.onnx.ml's
    ArrayFeatureExtractor, ZipMap's maps), with the nodes and initializers only they use, so that
    the outputs the loss needs train. Returns the names dropped (a ``DroppedOutputsWarning``); an
    output in ``keep`` is never dropped, so an op it needs is still refused by name."""
    import_all_converters()
    graph, keep = model.graph, set(keep)

    def computable(output: onnx.ValueInfoProto) -> bool:
        if not output.type.HasField("tensor_type") or output.type.tensor_type.elem_type == onnx.TensorProto.STRING:
            return False
        cone = onnx.GraphProto()
        cone.node.extend(_cone(graph, [output.name]))
        return all(importable(node) for node in all_nodes(cone))

    dropped = [o.name for o in graph.output if o.name not in keep and not computable(o)]
    if not dropped:
        return []
    kept_outputs = [o for o in graph.output if o.name not in dropped]
    live = _cone(graph, [o.name for o in kept_outputs])
    read = {name for node in live for name in node_reads(node)} | {o.name for o in kept_outputs}
    del graph.output[:]
    graph.output.extend(kept_outputs)
    nodes = list(live)
    del graph.node[:]
    graph.node.extend(nodes)
    unused = {init.name for init in graph.initializer if init.name not in read}
    initializers = [init for init in graph.initializer if init.name not in unused]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    inputs = [i for i in graph.input if i.name not in unused]
    del graph.input[:]
    graph.input.extend(inputs)
    warnings.warn(f"model output(s) {dropped} are left out of the training and eval graphs: the loss does not use "
                  "them and bridge cannot compute them (export_inference keeps them)", DroppedOutputsWarning, stacklevel=4)
    return dropped


def known_value(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """The value of ``name`` in ``model``'s top-level graph when it is known before the model runs: computed
    only from initializers and Constant nodes (pinned inputs among them), folded by ``OnnxProgram`` as at
    import; None when it reads a graph input, a random op or an op bridge cannot import."""
    graph = model.graph
    cone = _cone(graph, [name])
    constants = {init.name for init in graph.initializer}
    data = {i.name for i in graph.input} - constants
    reads = {read for node in cone for read in node_reads(node)}
    if not cone or reads & data or any(not importable(n) or n.op_type in _NOT_FOLDABLE
                                        for n in all_nodes(onnx.helper.make_graph(cone, "cone", [], []))):
        return None
    part = onnx.ModelProto(ir_version=model.ir_version)
    part.opset_import.extend(model.opset_import)
    part.graph.node.extend(cone)
    part.graph.initializer.extend(init for init in graph.initializer if init.name in reads)
    part.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    outputs, _ = OnnxProgram(part).run({}, {}, training=False)
    return outputs[0].numpy()


def relus_pooled_first(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """The Relu nodes of ``graph`` that ``OnnxProgram`` runs after the MaxPool that reads them, by output
    name: ``MaxPool(Relu(x))`` as ``Relu(MaxPool(x))``, the Relu on the pooled (smaller) tensor, its
    backward mask too (docs/lowerings/conv_pool.md).

    The values are equal (max and Relu commute), and so is every gradient, bit for bit: a window
    whose maximum is positive has the same first maximum either way (Relu changes no positive value
    and adds no tie above 0), and a window whose maximum is <= 0 passes no gradient either way (Relu's
    mask at its pooled value, or at the first of its zeros). Only where the Relu's output is read by
    that MaxPool alone (no other node, subgraph or graph output) and the MaxPool has no Indices output."""
    readers = collections.Counter(name for node in all_nodes(graph) for name in node.input)
    pooled = {node.input[0] for node in graph.node
              if node.op_type == "MaxPool" and node.input and [o for o in node.output if o] == node.output[:1]}
    outputs = {o.name for o in graph.output}
    return {node.output[0]: node for node in graph.node
            if node.op_type == "Relu" and node.output[0] in pooled and readers[node.output[0]] == 1
            and node.output[0] not in outputs}


@contextlib.contextmanager
def eager():
    """Run torch ops for real, even inside make_fx tracing (to fold values known up front)."""
    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        yield


@contextlib.contextmanager
def _named_errors(node: onnx.NodeProto):
    """The default node scope: a converter that fails on the given inputs (e.g. a sequence length
    the model pins, broadcast against a constant table) raises ``ShapeError`` naming the node."""
    try:
        yield
    except RuntimeError as exc:
        raise ShapeError(f"{node.op_type} node '{node.name}' fails on these inputs ({exc}); give the shapes "
                         "the model takes (input_shapes=)") from exc


def lift_attribute_weights(model: onnx.ModelProto) -> list[str]:
    """Move the float-list attributes that converters declare as weights (``attribute_weights=``) of the
    top-level nodes into initializers ``<node>.<attribute>``, appended to the node's inputs (in place);
    their names. A lifted tensor takes the type of the node's first input (ONNX type inference) where
    that is a float type (a float64 model computes in float64), else float32, the type ONNX gives these
    attributes."""
    graph = model.graph
    lifting = [node for node in graph.node if CONVERTERS[op_key(node.domain, node.op_type)].attribute_weights]
    if not lifting:
        return []
    inferred = onnx.shape_inference.infer_shapes(skeleton(model)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.value_info]}
    types.update({init.name: init.data_type for init in graph.initializer})
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
    lifted = []
    for node in lifting:
        for name in CONVERTERS[op_key(node.domain, node.op_type)].attribute_weights:
            values = next((list(a.floats) for a in node.attribute if a.name == name), None)
            if values is None:
                continue
            elem = types.get(node.input[0]) if node.input else None
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem if elem in floats else onnx.TensorProto.FLOAT)
            tensor = numpy_helper.from_array(np.asarray(values, np.float32).astype(dtype), f"{node.name}.{name}")
            graph.initializer.append(tensor)
            node.input.append(tensor.name)
            kept = [a for a in node.attribute if a.name != name]
            del node.attribute[:]
            node.attribute.extend(kept)
            lifted.append(tensor.name)
    return lifted


class OnnxProgram:
    """An ONNX graph that runs on torch tensors (eagerly or under tracing)."""

    def __init__(self, model: onnx.ModelProto, *, frozen_batch_norm: bool = False):
        import_all_converters()
        self.frozen_batch_norm = frozen_batch_norm  # BatchNorm normalizes with its running statistics in training
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model)
        self._check_supported()
        lift_attribute_weights(model)
        # writable arrays (to_array gives read-only views), so that weight tensors can share their memory
        self.initializers: dict[str, np.ndarray] = {
            init.name: np.array(numpy_helper.to_array(init)) for init in self.graph.initializer
        }
        # the model without the data of its big initializers (in self.initializers now): one copy of the weights
        self.model = skeleton(model)
        self.graph = self.model.graph
        self.input_names = [i.name for i in self.graph.input if i.name not in self.initializers]
        self.output_names = [o.name for o in self.graph.output]
        self.buffer_names = self._buffer_initializers()
        self._pooled_first: dict[int, tuple[onnx.GraphProto, dict]] = {}  # relus_pooled_first per graph
        self._segments: dict[bool, dict[int, Segment]] = {}  # repeated_segments, by whether Relus pool first

    def _check_supported(self) -> None:
        unsupported: dict[str, list[str]] = {}
        for node in all_nodes(self.graph):
            if not importable(node):
                unsupported.setdefault(op_key(node.domain, node.op_type), []).append(node.name)
        strings = [v.name for v in list(self.graph.input) + list(self.graph.initializer)
                   if (v.data_type if isinstance(v, onnx.TensorProto) else v.type.tensor_type.elem_type) == onnx.TensorProto.STRING]
        if strings:
            unsupported.setdefault("string tensors", []).extend(strings)
        if unsupported:
            listing = "; ".join(f"{op} (nodes: {', '.join(names)})" for op, names in sorted(unsupported.items()))
            hint = f"; {ML_OPS_HINT}" if any(op.startswith("ai.onnx.ml::") for op in unsupported) else ""
            raise UnsupportedOpError(f"the model uses ONNX ops that bridge cannot import: {listing}{hint}")

    def _buffer_initializers(self) -> list[str]:
        names = []
        for node in self.graph.node:
            for index in CONVERTERS[op_key(node.domain, node.op_type)].buffers:
                name = node.input[index] if index < len(node.input) else ""
                if name in self.initializers and name not in names:
                    names.append(name)
        return names

    def floating_initializers(self) -> list[str]:
        """Initializers of a floating-point type that are not running statistics."""
        return [
            name
            for name, value in self.initializers.items()
            if np.issubdtype(value.dtype, np.floating) and name not in self.buffer_names
        ]

    def initializer_tensor(self, name: str) -> torch.Tensor:
        """The initializer as a tensor sharing its memory (no op bridge traces writes in place)."""
        return torch.from_numpy(self.initializers[name])

    def run(
        self,
        inputs: dict[str, torch.Tensor],
        tensors: dict[str, torch.Tensor],
        training: bool,
        node_scope: NodeScope = _named_errors,
        random: dict[str, torch.Tensor] | None = None,
        evaluation: bool = False,
        blocks: BlockReplay | BlockLayouts | None = None,
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """Evaluate the graph.

        ``inputs`` are the graph's data inputs; ``tensors`` are initializers passed as tensors
        (weights and buffers: they become traced values, all other initializers stay
        constants). ``random`` holds the noise inputs of random ops by name (``<node>.noise``);
        a missing one is drawn and added to it. ``evaluation`` (bridge's eval graph) runs the
        model as torch's ``eval()`` would, also where a node asks for training behaviour
        (BatchNormalization ``training_mode=1`` from a train-mode export). ``blocks``: the tracer's
        replay of repeated blocks (``repeated_segments``), given while tracing a training step, or their layouts in
        the conversion's example run on fake tensors (``BlockLayouts``). Returns
        the graph outputs and the updated buffers (training mode).
        """
        random = {} if random is None else random
        env: dict[str, object] = dict(self.initializers)
        env.update(tensors)
        env.update({name: _widened(value) for name, value in inputs.items()})
        updated: dict[str, torch.Tensor] = {}
        outputs = self._evaluate(self.graph, env, (training, updated, random, evaluation, node_scope), blocks)
        return [_as_output(value, _declared_dtype(o)) for value, o in zip(outputs, self.graph.output, strict=True)], updated

    def _evaluate(self, graph: onnx.GraphProto, env: MutableMapping[str, object], run: tuple,
                  blocks: BlockReplay | BlockLayouts | None = None) -> list:
        """Run the nodes of ``graph`` (the main graph or a subgraph) over ``env``; its outputs.

        Subgraphs: a converter of an op with subgraph attributes (If, Loop, Scan) calls
        ``ctx.run_graph(graph, bindings)``, which evaluates the subgraph here with its inputs bound
        to ``bindings`` over a view of the enclosing scope (``ChainMap``: outer values are visible,
        the subgraph's own values do not leak out). A loop is thus unrolled into straight-line code.
        With ``blocks`` (the main graph only), each repeated segment runs through it (``_run_segment``).
        """
        cached = self._pooled_first.get(id(graph))
        if cached is None or cached[0] is not graph:  # once per graph: a Loop body is evaluated per iteration
            cached = self._pooled_first[id(graph)] = (graph, relus_pooled_first(graph))  # (the graph held: ids stay)
        pooled_first = cached[1] if targets.enabled("relu_after_maxpool") else {}
        segments = {} if blocks is None else self._repeated_segments(pooled_first)
        index = 0
        while index < len(graph.node):
            segment = segments.get(index)
            if segment is not None and blocks is not None:
                self._run_segment(segment, env, run, blocks)
                index = segment.end
                continue
            self._run_step(graph.node[index], env, run, pooled_first)
            index += 1
        return [env[o.name] for o in graph.output]

    def _run_step(self, node: onnx.NodeProto, env: MutableMapping[str, object], run: tuple,
                  pooled_first: dict[str, onnx.NodeProto]) -> None:
        """Run ``node`` (a MaxPool with the Relu of ``pooled_first`` it reads after it), its outputs into ``env``."""
        node_scope = run[-1]
        if node.op_type == "Relu" and node.output[0] in pooled_first:
            return  # runs after its MaxPool, below
        relu = pooled_first.get(node.input[0]) if node.op_type == "MaxPool" else None
        inputs = env if relu is None else ChainMap({relu.output[0]: env[relu.input[0]]}, env)  # the Relu's input
        with node_scope(node):
            outputs = self._run_node(node, inputs, run)
        if relu is not None:
            with node_scope(relu):
                outputs = self._run_node(relu, ChainMap({relu.input[0]: outputs[0]}, env), run)
        for name, value in zip(node.output, outputs, strict=False):
            if name:
                env[name] = value

    def _repeated_segments(self, pooled_first: dict[str, onnx.NodeProto]) -> dict[int, Segment]:
        """``repeated_segments`` of the main graph, without the nodes that random ops, control flow and the
        Relu-after-MaxPool order run differently."""
        key = bool(pooled_first)
        if key not in self._segments:
            pooled = {relu.input[0] for relu in pooled_first.values()} | set(pooled_first)

            def replayable(node: onnx.NodeProto) -> bool:
                conv = CONVERTERS[op_key(node.domain, node.op_type)]
                return not conv.raw and node.op_type not in _NOT_FOLDABLE and not pooled & {*node.input, *node.output}

            self._segments[key] = repeated_segments(self.graph, replayable)
        return self._segments[key]

    def _run_segment(self, segment: Segment, env: MutableMapping[str, object], run: tuple,
                     blocks: BlockReplay | BlockLayouts) -> None:
        """Run a repeated segment through ``blocks``, keyed by its signature, the mode of the run and the values of
        its arguments known before the model runs (its tensors ``blocks`` keys); its output and the buffers it
        updates into ``env`` and the run's updated buffers."""
        training, updated, random, evaluation, node_scope = run
        nodes = self.graph.node[segment.start:segment.end]
        values = [env[name] for name in segment.args]
        buffers = {node.input[i] for node in nodes
                   for i in CONVERTERS[op_key(node.domain, node.op_type)].buffers if i < len(node.input)}
        buffer_args = [name for name in segment.args if name in buffers]

        tensor_args = [name for name, value in zip(segment.args, values, strict=True) if isinstance(value, torch.Tensor)]

        def block(tensors: list[torch.Tensor]) -> list:
            scope: MutableMapping[str, object] = ChainMap(dict(zip(tensor_args, tensors, strict=True)), env)
            updated_here: dict[str, torch.Tensor] = {}
            for node in nodes:
                self._run_step(node, scope, (training, updated_here, random, evaluation, node_scope), {})
            return [scope[segment.output], *(updated_here.get(name) for name in buffer_args)]

        try:
            key = (segment.signature, training, evaluation, tuple(_constant_key(value) for value in values))
        except Unkeyable:
            outputs = block([env[name] for name in tensor_args])
        else:
            outputs = blocks.run(key, [env[name] for name in tensor_args], segment.layers, block)
        env[segment.output] = outputs[0]
        updated.update({name: value for name, value in zip(buffer_args, outputs[1:], strict=True) if value is not None})

    def _run_node(self, node: onnx.NodeProto, env: MutableMapping, run: tuple) -> list:
        conv = CONVERTERS[op_key(node.domain, node.op_type)]
        training, updated, random, evaluation, _ = run

        def run_graph(graph: onnx.GraphProto, bindings: dict) -> list:
            return self._evaluate(graph, ChainMap(dict(bindings), env), run)

        ctx = NodeContext(node, self.opset, training, updated, random, evaluation, run_graph, self.frozen_batch_norm)
        args = []
        for index, name in enumerate(node.input):
            if not name:
                args.append(None)
                continue
            value = env[name]
            if index in conv.static:
                if isinstance(value, torch.Tensor):
                    if name not in self.initializers:
                        raise ShapeError(
                            f"{node.op_type} node '{node.name}': input {index} ('{name}') must be known "
                            "before the model runs (a constant or a static shape), but it is computed from data; "
                            "if it derives from a graph input that always has the same value (a flag), pin that "
                            "input: constant_inputs={'<input>': value} in bridge.to_training_onnx, "
                            "--constant-input <input>=value with bridge convert"
                        )
                    value = self.initializers[name]
            args.append(value)
        if conv.raw:  # folds node by node itself (control flow: subgraphs read outer values)
            return _as_list(conv.fn(ctx, *args))
        foldable = node.op_type not in _NOT_FOLDABLE and all(
            a is None or isinstance(a, np.ndarray) for a in args
        )
        if foldable and node.input:
            if any(is_symbolic(a) for a in args):
                if folds_symbolic(node.op_type, args):
                    return fold_symbolic(ctx, args)
                return self._call(conv.fn, ctx, args, conv.static)  # traced: sizes stay symbolic
            with eager():
                return [_to_numpy(o) for o in self._call(conv.fn, ctx, args, conv.static)]
        return self._call(conv.fn, ctx, args, conv.static)

    @staticmethod
    def _call(fn, ctx: NodeContext, args: list, static: Iterable[int]) -> list:
        static = set(static)
        tensor_args = [
            a if (a is None or i in static or not isinstance(a, np.ndarray)) else _to_tensor(a)
            for i, a in enumerate(args)
        ]
        return _as_list(fn(ctx, *tensor_args))


def _constant_key(value: object) -> tuple | None:
    """A segment argument's part of the segment's key: a tensor's place (``BlockReplay`` keys its layout), None,
    or an array known before the model runs by its type, shape and data; anything else raises ``Unkeyable``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return ("tensor",)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return ("array", value.dtype.str, value.shape, hashlib.blake2b(np.ascontiguousarray(value).tobytes()).digest())
    raise Unkeyable(type(value).__name__)


def _as_list(out) -> list:
    """A converter's result as the list of the node's outputs."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _as_output(value, declared: np.dtype | None = None):
    """A graph output as a tensor (a sequence output: a list of tensors) of its ``declared`` type
    where that is a type computed as int64 (``WIDE_UNSIGNED``) or an integer type computed as
    float (QuantizeLinear's fake-quantization carrier, bridge/pipeline/importer/ops/quantize.py)."""
    if isinstance(value, list):
        return [_as_output(v) for v in value]
    tensor = value if isinstance(value, torch.Tensor) else _to_tensor(np.asarray(value))
    carried = declared is not None and np.issubdtype(declared, np.integer) and tensor.is_floating_point()
    return tensor.to(getattr(torch, declared.name)) if declared in WIDE_UNSIGNED or carried else tensor


def _declared_dtype(value: onnx.ValueInfoProto) -> np.dtype | None:
    elem_type = value.type.tensor_type.elem_type
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type) if elem_type else None


def _widened(value):
    """A uint16/32/64 tensor as int64 (see ``WIDE_UNSIGNED``); anything else unchanged."""
    return value.to(torch.int64) if isinstance(value, torch.Tensor) and value.dtype in _WIDE_UNSIGNED_TORCH else value


def _to_numpy(value):
    """A folded output as numpy (a sequence output, a list, element by element)."""
    if isinstance(value, list):
        return [_to_numpy(v) for v in value]
    return value if isinstance(value, np.ndarray) else value.detach().numpy()


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    if is_symbolic(array):  # sizes that involve the symbolic batch, used as tensor data
        items = [torch.scalar_tensor(v, dtype=torch.int64) for v in array.reshape(-1)]
        return torch.stack(items).reshape(array.shape) if items else torch.zeros(array.shape, dtype=torch.int64)
    if array.dtype in WIDE_UNSIGNED:
        return torch.from_numpy(array.astype(np.int64))
    # shared, not copied: a frozen weight then stays one tensor, which the exporter names after it
    shareable = array.flags.writeable and array.flags.c_contiguous
    return torch.from_numpy(array if shareable else np.array(array, copy=True))

