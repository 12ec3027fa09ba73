"""An oracle for the wild tier that shares no code with bridge: central finite differences of the
original ONNX file, run in float64 by onnxruntime (the model's float tensors and types retyped to
double) or by ``onnx.reference`` where onnxruntime has no double kernel, and the loss in numpy.

A trained tensor is whatever bridge names as a weight: an initializer, the output of a node
(paddle2onnx's Constants, spox's Constants inside an If branch) that the oracle removes and feeds
instead, or a float-list attribute ``<node>.<attribute>`` (ai.onnx.ml's coefficients), which
onnx.reference's own op reads from the oracle in float64. For a random unit direction
``d`` the directional derivative ``dL/dw . d`` is estimated as ``(L(w + h d) - L(w - h d)) / 2h``
at two steps ``h`` and ``h / 2``; their difference measures the estimate's own error, and a
gradient passes when ``|grad . d - fd(h / 2)|`` is within ``NOISE_MULTIPLE`` times that error or
``RTOL`` of the whole gradient's norm (float64 rounding, which the two steps cannot see below it:
a tensor whose gradient is exactly zero, a conv bias before a batch norm, gets rounding of the
size of the others' gradients). When both steps cross the same kink (a ReLU input or a max-pool
tie closer than ``h``), they agree with each other but not with the derivative: a direction that
fails is measured again at ``KINK_STEPS``, ten times smaller."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_average_pool import AveragePool_19 as OpAveragePool
from onnx.reference.ops.op_lrn import LRN as OpLRN
from onnx.reference.ops.op_max_pool import MaxPool as OpMaxPool

STEPS = (1e-4, 5e-5)
KINK_STEPS = (1e-5, 5e-6)
NOISE_MULTIPLE = 10.0
RTOL = 1e-7
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
# Inputs that ONNX types as float32 whatever the data (the scales of Resize and Upsample).
FLOAT32_ONLY_INPUTS = {"Resize": (2,), "Upsample": (1,)}


def _retype(elem: int) -> int:
    return TensorProto.DOUBLE if elem in FLOATS else elem


def _double_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_type not in FLOATS:
        return tensor
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def _float32_only(graph: onnx.GraphProto) -> set[str]:
    return {node.input[i] for node in graph.node for i in FLOAT32_ONLY_INPUTS.get(node.op_type, ())
            if i < len(node.input) and node.input[i]}


def _double_graph(graph: onnx.GraphProto) -> None:
    keep = _float32_only(graph)
    for values in (graph.input, graph.output, graph.value_info):
        for value in values:
            if value.type.HasField("tensor_type") and value.name not in keep:
                value.type.tensor_type.elem_type = _retype(value.type.tensor_type.elem_type)
    for tensor in graph.initializer:
        if tensor.name not in keep:
            tensor.CopyFrom(_double_tensor(tensor))
    for node in graph.node:
        constant_kept = node.op_type == "Constant" and node.output[0] in keep
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and not constant_kept:
                attr.t.CopyFrom(_double_tensor(attr.t))
            elif attr.type == onnx.AttributeProto.GRAPH:
                _double_graph(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attr.graphs:
                    _double_graph(subgraph)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                attr.i = _retype(attr.i)
        if node.op_type == "Constant" and not constant_kept:
            for attr in node.attribute:  # value_float(s) make float32: rewritten as a double tensor
                if attr.name in ("value_float", "value_floats"):
                    value = np.array(attr.f if attr.name == "value_float" else list(attr.floats), np.float64)
                    del node.attribute[:]
                    node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))
                    break


def to_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64: every float tensor, type, Cast target and random
    op dtype retyped (Resize scales stay float32); value_info dropped (inference recomputes it)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    del model.graph.value_info[:]
    _double_graph(model.graph)
    return model


def _dropout_as_kept(graph: onnx.GraphProto) -> None:
    """Train-mode Dropout with every unit kept (``x / (1 - ratio)``): what a training step computes
    when its dropout noise keeps all units, so that one step is deterministic and comparable."""
    nodes = []
    for node in graph.node:
        if node.op_type != "Dropout":
            nodes.append(node)
            continue
        ratio = next((a.f for a in node.attribute if a.name == "ratio"), 0.5)
        scale = helper.make_tensor(node.output[0] + ".kept_scale", TensorProto.FLOAT, [], [1.0 / (1.0 - ratio)])
        graph.initializer.append(scale)
        nodes.append(helper.make_node("Mul", [node.input[0], scale.name], [node.output[0]]))
    del graph.node[:]
    graph.node.extend(nodes)


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _batch_statistics(model: onnx.ModelProto) -> None:
    """BatchNormalization with the batch's statistics (mean and biased variance over every axis
    but the channel's), as a training step normalizes; the running statistics are not read."""
    graph = model.graph
    opset = _opset(model)
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in [*onnx.shape_inference.infer_shapes(model).graph.value_info, *graph.input]
             if v.type.tensor_type.HasField("shape")}
    nodes = []
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            nodes.append(node)
            continue
        x, scale, bias = node.input[:3]
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        rank = ranks.get(x, 4)
        axes = [0, *range(2, rank)]
        name = node.output[0] + ".batch"
        shape = helper.make_tensor(name + "_shape", TensorProto.INT64, [rank], [1, -1] + [1] * (rank - 2))
        constants = [shape, helper.make_tensor(name + "_eps", TensorProto.FLOAT, [], [eps])]
        if opset >= 18:
            constants.append(helper.make_tensor(name + "_axes", TensorProto.INT64, [len(axes)], axes))
            reduce = {"inputs": [name + "_axes"], "attrs": {}}
        else:
            reduce = {"inputs": [], "attrs": {"axes": axes}}
        graph.initializer.extend(constants)
        nodes += [
            helper.make_node("ReduceMean", [x, *reduce["inputs"]], [name + "_mean"], keepdims=1, **reduce["attrs"]),
            helper.make_node("Sub", [x, name + "_mean"], [name + "_centered"]),
            helper.make_node("Mul", [name + "_centered", name + "_centered"], [name + "_sq"]),
            helper.make_node("ReduceMean", [name + "_sq", *reduce["inputs"]], [name + "_var"], keepdims=1,
                             **reduce["attrs"]),
            helper.make_node("Add", [name + "_var", name + "_eps"], [name + "_vareps"]),
            helper.make_node("Sqrt", [name + "_vareps"], [name + "_std"]),
            helper.make_node("Div", [name + "_centered", name + "_std"], [name + "_normed"]),
            helper.make_node("Reshape", [scale, name + "_shape"], [name + "_scale"]),
            helper.make_node("Reshape", [bias, name + "_shape"], [name + "_bias"]),
            helper.make_node("Mul", [name + "_normed", name + "_scale"], [name + "_scaled"]),
            helper.make_node("Add", [name + "_scaled", name + "_bias"], [node.output[0]]),
        ]
    del graph.node[:]
    graph.node.extend(nodes)


def train_mode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing what a training step computes: Dropout keeps every unit (the
    step is fed noise that does), BatchNormalization uses the batch's statistics."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    _dropout_as_kept(model.graph)
    _batch_statistics(model)
    return model


def numpy_loss(loss: str, output: np.ndarray, target: np.ndarray) -> float:
    """torch's mean-reduced losses in numpy float64: ``mse``, and ``ce`` (logits ``(N, C, ...)``,
    class indices ``(N, ...)``)."""
    output = np.asarray(output, np.float64)
    if loss == "mse":
        return float(np.mean((output - target) ** 2))
    if loss == "ce":
        shifted = output - output.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        picked = np.take_along_axis(logp, np.expand_dims(target.astype(np.int64), 1), axis=1)
        return float(-picked.mean())
    raise ValueError(f"loss {loss!r}: the oracle knows mse and ce")


Run = Callable[[Mapping[str, np.ndarray]], list]


class GlobalMaxPool(OpRun):
    """onnx.reference's GlobalMaxPool drops the spatial axes; ONNX keeps them as size 1."""

    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


class LRN(OpLRN):
    """onnx.reference's LRN loops over the batch axis where it means the channels: every channel
    from the batch size on is left unnormalized. The ONNX definition: squares summed over the
    channels ``c - floor((size - 1) / 2) .. c + ceil((size - 1) / 2)``."""

    def _run(self, x, alpha=None, beta=None, bias=None, size=None):
        before, after = (size - 1) // 2, size // 2
        squares = np.pad(x * x, [(0, 0), (before, after), *[(0, 0)] * (x.ndim - 2)])
        summed = np.lib.stride_tricks.sliding_window_view(squares, size, axis=1).sum(axis=-1)
        return ((x / (bias + alpha / size * summed) ** beta).astype(x.dtype),)


def _windows(x: np.ndarray, kernel: list[int], strides: list[int] | None, pads: list[int] | None,
             fill: float) -> np.ndarray:
    """The pooling windows of ``x`` (explicit ``pads`` filled with ``fill``, floor rounding):
    ``(N, C, *output, *kernel)``."""
    spatial = x.ndim - 2
    pads = pads or [0] * (2 * spatial)
    padded = np.pad(x, [(0, 0), (0, 0), *zip(pads[:spatial], pads[spatial:], strict=True)], constant_values=fill)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=tuple(range(2, x.ndim)))
    return windows[(slice(None), slice(None), *(slice(None, None, s) for s in strides or [1] * spatial))]


def _windowed(node: onnx.NodeProto, auto_pad, ceil_mode, dilations) -> bool:
    """Whether a pool has one output, explicit pads, floor rounding and no dilation: what
    ``_windows`` computes."""
    return (len(node.output) == 1 and auto_pad in (None, "NOTSET", "VALID") and not ceil_mode
            and all(d == 1 for d in dilations or []))


class _WindowedPool:
    """onnx.reference's MaxPool and AveragePool loop in Python over every output element (minutes
    per run of an ImageNet CNN): where ``_windowed``, a reduction over strided windows instead."""

    op_domain = ""
    onnx_node: onnx.NodeProto

    def _pads(self, auto_pad, pads):
        return None if auto_pad == "VALID" else pads


class _MaxPool(_WindowedPool, OpMaxPool):
    def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None, storage_order=None,
             strides=None):
        if not _windowed(self.onnx_node, auto_pad, ceil_mode, dilations):
            return super()._run(x, auto_pad, ceil_mode, dilations, kernel_shape, pads, storage_order, strides)
        windows = _windows(x, kernel_shape, strides, self._pads(auto_pad, pads), -np.inf)
        return (windows.max(axis=tuple(range(x.ndim, windows.ndim))),)


class _AveragePool(_WindowedPool, OpAveragePool):
    def _run(self, x, auto_pad=None, ceil_mode=None, dilations=None, kernel_shape=None, pads=None, strides=None,
             count_include_pad=None):
        if not _windowed(self.onnx_node, auto_pad, ceil_mode, dilations):
            return super()._run(x, auto_pad, ceil_mode, dilations, kernel_shape, pads, strides, count_include_pad)
        pads = self._pads(auto_pad, pads)
        axes = tuple(range(x.ndim, 2 * x.ndim - 2))
        total = _windows(x, kernel_shape, strides, pads, 0.0).sum(axis=axes)
        if count_include_pad:
            return ((total / np.prod(kernel_shape)).astype(x.dtype),)
        counted = _windows(np.ones((1, 1, *x.shape[2:]), x.dtype), kernel_shape, strides, pads, 0.0).sum(axis=axes)
        return ((total / counted).astype(x.dtype),)


def _pool_ops(opset: int) -> list[type[OpRun]]:
    """MaxPool and AveragePool with the model's opset's attribute defaults."""
    return [type(name, (base,), {"op_schema": onnx.defs.get_schema(name, opset)})
            for name, base in (("MaxPool", _MaxPool), ("AveragePool", _AveragePool))]


class _Coerced2D(OpRun):
    """Softmax, LogSoftmax and Hardmax before opset 13: the input seen as 2-D (the axes before
    ``axis`` by the rest) and normalized over its second dimension. onnx.reference implements only
    the opset-13 form (over the one ``axis``), which differs unless the axes after ``axis`` have size 1."""

    op_domain = ""

    def _run(self, x, axis=1):
        rows = x.reshape(int(np.prod(x.shape[:axis % x.ndim])), -1)
        return (np.asarray(self.normalize(rows)).reshape(x.shape).astype(x.dtype),)


def _softmax(rows: np.ndarray) -> np.ndarray:
    exp = np.exp(rows - rows.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _hardmax(rows: np.ndarray) -> np.ndarray:
    return np.eye(rows.shape[1], dtype=rows.dtype)[rows.argmax(axis=1)]


def _coerced_2d_ops(opset: int) -> list[type[OpRun]]:
    """The opset's own Softmax, LogSoftmax and Hardmax where they coerce to 2-D (opset < 13), with
    that opset's attribute defaults."""
    if opset >= 13:
        return []
    return [type(name, (_Coerced2D,), {"op_schema": onnx.defs.get_schema(name, opset), "normalize": staticmethod(fn)})
            for name, fn in (("Softmax", _softmax), ("LogSoftmax", _log_softmax), ("Hardmax", _hardmax))]


class ZipMap(OpRun):
    """ai.onnx.ml ZipMap, which onnx.reference lacks: per row, a map from class label to value."""

    op_domain = "ai.onnx.ml"

    def _run(self, x, classlabels_int64s=None, classlabels_strings=None):
        labels = classlabels_int64s if classlabels_int64s is not None else classlabels_strings
        return ([dict(zip(labels, row, strict=True)) for row in x],)


def maps_as_rows(value):
    """ZipMap's maps (a list of dicts) as the array of their values, one row per map in class-label order;
    any other value as it is."""
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return np.array([list(row.values()) for row in value])
    return value


def as_array(value) -> np.ndarray:
    """An output as a float64 array (``maps_as_rows``)."""
    return np.asarray(maps_as_rows(value), np.float64)


def _attribute_weights(graph: onnx.GraphProto, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The float-list attributes that bridge trains as ``<node>.<attribute>`` (ai.onnx.ml's coefficients
    and intercepts), as float64 arrays."""
    names = set(names)
    return {f"{node.name}.{attr.name}": np.array(attr.floats, np.float64) for node in graph.node
            for attr in node.attribute if f"{node.name}.{attr.name}" in names and attr.type == onnx.AttributeProto.FLOATS}


def _attribute_fed_ops(graph: onnx.GraphProto, fed: Mapping[str, np.ndarray]) -> list[type[OpRun]]:
    """onnx.reference's own classes of the ai.onnx.ml ops whose attributes ``fed`` holds, reading those
    attributes from ``fed`` (float64, changed between runs by the finite differences) instead of the
    node, whose float attributes are float32."""
    from onnx.reference.ops.aionnxml import _op_list

    def fed_run(base: type[OpRun]):
        def _run(self, *inputs, **attributes):
            return base._run(self, *inputs, **{k: fed.get(f"{self.onnx_node.name}.{k}", v) for k, v in attributes.items()})
        return _run

    types = {node.op_type for node in graph.node
             if node.domain == "ai.onnx.ml" and any(f"{node.name}.{a.name}" in fed for a in node.attribute)}
    return [type(op_type, (getattr(_op_list, op_type),), {"_run": fed_run(getattr(_op_list, op_type))})
            for op_type in sorted(types)]


def reference_run(model: onnx.ModelProto, outputs: list[str], new_ops: Iterable[type[OpRun]] = ()) -> Run:
    """``onnx.reference``'s evaluator of ``outputs``, with the ops it implements only in their
    latest form replaced by the model's opset's, its LRN corrected, its pools vectorized, ZipMap added,
    and ``new_ops``."""
    from onnx.reference import ReferenceEvaluator

    opset = _opset(model)
    evaluator = ReferenceEvaluator(model, new_ops=[GlobalMaxPool, LRN, ZipMap, *_pool_ops(opset), *_coerced_2d_ops(opset),
                                                   *new_ops])
    return lambda values: evaluator.run(outputs, dict(values))


def _session(model: onnx.ModelProto, outputs: list[str], feeds: Mapping[str, np.ndarray]) -> tuple[str, Run]:
    """A float64 evaluator of ``outputs``: onnxruntime where it runs every node in double at
    ``feeds``, else ``onnx.reference``; returns the engine's name and the run function."""
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(outputs, dict(feeds))
        return "onnxruntime", lambda values: session.run(outputs, dict(values))
    except Exception as error:  # noqa: BLE001 - missing double kernels: use the reference
        if not any(sign in str(error) for sign in ("NOT_IMPLEMENTED", "not support double", "Could not find")):
            raise
    return "onnx.reference", reference_run(model, outputs)


def _with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    return model


def _cast_feeds(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}


@dataclasses.dataclass
class Oracle:
    """The float64 ``output`` of a model as a function of its trained tensors (every other input
    fixed), and the loss of it against ``target`` once that is set."""

    engine: str
    base: dict[str, np.ndarray]
    output: Callable[[Mapping[str, np.ndarray]], np.ndarray]
    loss: str = "mse"
    target: np.ndarray | None = None

    def loss_of(self, values: Mapping[str, np.ndarray]) -> float:
        """The loss with the trained tensors ``values`` replaced (the others at ``base``)."""
        assert self.target is not None, "set the oracle's target first"
        target = self.target.astype(np.float64) if self.loss == "mse" else self.target
        return numpy_loss(self.loss, self.output(values), target)


def _subgraphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """The subgraphs of ``graph``'s nodes (If branches, Loop and Scan bodies), recursively."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in [*attr.graphs, *([attr.g] if attr.type == onnx.AttributeProto.GRAPH else [])]:
                yield sub
                yield from _subgraphs(sub)


def _take_branch_constants(graph: onnx.GraphProto, names: list[str]) -> dict[str, np.ndarray]:
    """The values of the ``Constant`` nodes inside subgraphs (spox keeps weights in If branches) that output
    one of ``names``; each such node is removed, so that the value is read from the outer scope, where the
    oracle feeds it as a graph input."""
    values = {}
    for sub in _subgraphs(graph):
        taken = [n for n in sub.node if n.op_type == "Constant" and n.output[0] in names
                 and [a.name for a in n.attribute] == ["value"]]
        values.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t).astype(np.float64) for n in taken})
        kept = [n for n in sub.node if n not in taken]
        del sub.node[:]
        sub.node.extend(kept)
    return values


def oracle(model: onnx.ModelProto, output: str, weights: Iterable[str], feeds: Mapping[str, np.ndarray]) -> Oracle:
    """The oracle of ``model``'s ``output`` at ``feeds``. The trained tensors' values are read from
    the model itself: an initializer's data, or a node output evaluated once in float64; that node
    is then removed and its output fed. The model runs in ``train_mode``."""
    weights = list(weights)
    double = to_double(train_mode(model))
    feeds64 = _cast_feeds(feeds)
    graph = double.graph
    initializers = {t.name: t for t in graph.initializer}
    base = {w: numpy_helper.to_array(initializers[w]).astype(np.float64) for w in weights if w in initializers}
    base.update(_take_branch_constants(graph, [w for w in weights if w not in base]))
    fed = _attribute_weights(graph, [w for w in weights if w not in base])
    base.update({w: v.copy() for w, v in fed.items()})
    computed = [w for w in weights if w not in base]
    if computed:
        probe = _with_outputs(onnx.ModelProto.FromString(double.SerializeToString()), computed)
        base.update(zip(computed, _session(probe, computed, feeds64)[1](feeds64), strict=True))
    producers = [n for n in graph.node if set(n.output) & set(computed)]
    if any(len(n.output) > 1 for n in producers):
        raise ValueError("a trained tensor is one output of a multi-output node: not a weight")
    kept_nodes = [n for n in graph.node if n not in producers]
    kept = [t for t in graph.initializer if t.name not in base]
    del graph.initializer[:], graph.node[:]
    graph.initializer.extend(kept)
    graph.node.extend(kept_nodes)
    listed = {i.name for i in graph.input}  # before IR 4 an initializer is also a graph input
    graph.input.extend(helper.make_tensor_value_info(w, TensorProto.DOUBLE, list(base[w].shape))
                       for w in weights if w not in listed and w not in fed)
    fed_inputs = [w for w in weights if w not in fed]
    if fed:  # attributes read from ``fed``: onnx.reference's ops, in float64
        engine, run = "onnx.reference", reference_run(_with_outputs(double, [output]), [output],
                                                      _attribute_fed_ops(graph, fed))
    else:
        engine, run = _session(_with_outputs(double, [output]), [output], {**feeds64, **base})

    def evaluate(values: Mapping[str, np.ndarray]) -> np.ndarray:
        fed.update({w: values.get(w, base[w]) for w in fed})
        return as_array(run({**feeds64, **{w: values.get(w, base[w]) for w in fed_inputs}})[0])

    return Oracle(engine, base, evaluate)


@dataclasses.dataclass
class Check:
    """One directional derivative: bridge's ``grad . d``, finite differences at the two steps,
    and the tolerance they give."""

    weights: tuple[str, ...]
    analytic: float
    fd: float
    fd_coarse: float
    tolerance: float

    @property
    def error(self) -> float:
        return abs(self.analytic - self.fd)

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def check_gradients(truth: Oracle, grads: Mapping[str, np.ndarray], *, directions: int = 2, seed: int = 0,
                    per_tensor: Iterable[str] | None = None) -> list[Check]:
    """Compare ``grads`` (weight -> gradient of the mean loss) with finite differences along random
    unit directions: ``directions`` per tensor of ``per_tensor`` (default every tensor), and as
    many over all tensors at once."""
    rng = np.random.default_rng(seed)
    grads = {w: np.asarray(g, np.float64) for w, g in grads.items()}
    names = list(grads if per_tensor is None else per_tensor)
    groups = [(w,) for w in names for _ in range(directions)] + [tuple(grads)] * directions
    overall = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))  # float64 rounding scales with it
    checks = []
    for group in groups:
        d = {w: rng.standard_normal(truth.base[w].shape) for w in group}
        norm = np.sqrt(sum(float(np.sum(v * v)) for v in d.values())) or 1.0
        d = {w: v / norm for w, v in d.items()}
        analytic = float(sum(np.sum(grads[w] * d[w]) for w in group))
        for steps in (STEPS, KINK_STEPS):
            fds = [(truth.loss_of({w: truth.base[w] + h * d[w] for w in group})
                    - truth.loss_of({w: truth.base[w] - h * d[w] for w in group})) / (2 * h) for h in steps]
            scale = abs(fds[1]) + overall
            tolerance = max(NOISE_MULTIPLE * abs(fds[0] - fds[1]), RTOL * scale, 1e-300)
            check = Check(group, analytic, fds[1], fds[0], tolerance)
            if check.ok:
                break
        checks.append(check)
    return checks


def rejects_wrong_gradients(checks: list[Check]) -> dict[str, bool]:
    """Whether the same finite differences reject a gradient scaled by 1.01 and a sign-flipped one
    (each fails at least one check that the real gradient passes): the oracle's power."""
    def rejected(factor: float) -> bool:
        return any(abs(factor * c.analytic - c.fd) > c.tolerance for c in checks if c.ok)

    return {"scaled by 1.01": rejected(1.01), "sign flipped": rejected(-1.0)}
