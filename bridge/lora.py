"""LoRA adapters as an ONNX-level rewrite (docs/lora.md).

``inject_lora`` adds a low-rank path beside each targeted Gemm/MatMul/Conv whose weight is an
initializer: ``y = base(x) + (alpha / rank) * B(A(x))``, A initialized as peft does (torch.nn.Linear's
kaiming-uniform), B zeros, so the injected model computes what the source does until B is trained.
``merge_lora`` folds trained adapters back into the base weights (``W + scale * B @ A``);
``save_adapters`` / ``load_adapters`` keep the adapters apart from the base model.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .attributes import attribute
from .contract import LORA_PLAN
from .errors import InvalidModelError, InvalidOptionError
from .onnx_file import fresh_name, read_model

OPS = ("Gemm", "MatMul", "Conv")
PLAN_KEY = "lora_plan"  # the plan's JSON in an adapters .npz file


class LoraError(InvalidModelError):
    """A LoRA rewrite or merge that cannot be done on this model (the message names the node or weight)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter pair: ``a`` ([rank, in] or a [rank, in, *kernel] Conv kernel) and ``b`` ([out, rank] or
    [out, rank, 1, ...]) beside node ``node``, whose weight is initializer ``weight``. ``layout``: how the
    weight stores its features (``out_in`` for Gemm transB=1, a Transpose'd MatMul weight and Conv;
    ``in_out`` for Gemm transB=0 and a plain MatMul weight). ``scale``: the factor of ``B @ A`` in
    the weight (alpha / rank, times Gemm's alpha)."""

    a: str
    b: str
    weight: str
    node: str
    op: str
    layout: str
    scale: float


@dataclass(frozen=True)
class LoraPlan:
    """What ``inject_lora`` added: the adapters, and the options they were made with."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    adapters: tuple[LoraAdapter, ...]

    @property
    def adapter_names(self) -> list[str]:
        """Every adapter tensor (A and B of each pair): the weights to train (``trainable=``)."""
        return [name for adapter in self.adapters for name in (adapter.a, adapter.b)]

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                           "adapters": [asdict(a) for a in self.adapters]})

    @classmethod
    def from_json(cls, text: str) -> LoraPlan:
        data = json.loads(text)
        return cls(int(data["rank"]), float(data["alpha"]), tuple(data["targets"]),
                   tuple(LoraAdapter(**a) for a in data["adapters"]))


def check_lora_options(options: Mapping) -> tuple[int, float, tuple[str, ...], int]:
    """``lora=`` of ``to_training_onnx``: ``{"rank", "alpha", "targets", "seed"}`` checked, as
    (rank, alpha, targets, seed); alpha defaults to rank (scale 1), seed to 0."""
    if not isinstance(options, Mapping):
        raise InvalidOptionError(f"lora={options!r}: give a dict such as {{'rank': 8, 'alpha': 16, 'targets': ['*attn*']}}")
    unknown = sorted(set(options) - {"rank", "alpha", "targets", "seed"})
    if unknown:
        raise InvalidOptionError(f"lora= has unknown keys {unknown}; known: rank, alpha, targets, seed")
    if "targets" not in options:
        raise InvalidOptionError("lora= needs 'targets': fnmatch patterns of weight or node names, e.g. ['*attn*']")
    rank = options.get("rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise InvalidOptionError(f"lora rank={rank!r} is not valid; give an integer >= 1")
    alpha = options.get("alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.number)) or not math.isfinite(alpha):
        raise InvalidOptionError(f"lora alpha={alpha!r} is not valid; give a finite number")
    targets = options["targets"]
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets or not all(isinstance(t, str) for t in targets):
        raise InvalidOptionError(f"lora targets={options['targets']!r}: give a non-empty list of name patterns")
    seed = options.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InvalidOptionError(f"lora seed={seed!r} is not valid; give an integer")
    return int(rank), float(alpha), targets, int(seed)


def inject_for_training(model: str | os.PathLike | onnx.ModelProto, options: Mapping) -> tuple[onnx.ModelProto, LoraPlan]:
    """``to_training_onnx(lora=options)``: the model (a path or a ModelProto) with its adapters injected, and
    the plan. The options' keys are checked before the model is read."""
    check_lora_options(options)
    return inject_lora(read_model(model), **options)


def lora_trainable(plan: LoraPlan, trainable: Iterable[str] | str | None) -> list[str]:
    """The ``trainable=`` of a LoRA conversion: the adapters, and any weights ``trainable`` adds (a new
    classifier head, say) that are trained in full."""
    extra = [] if trainable is None else [trainable] if isinstance(trainable, str) else list(trainable)
    return plan.adapter_names + extra


def plan_of(model: onnx.ModelProto) -> LoraPlan | None:
    """The LoRA plan a training (or eval) graph carries in its metadata, or None."""
    for entry in model.metadata_props:
        if entry.key == LORA_PLAN:
            return LoraPlan.from_json(entry.value)
    return None


def lora_inference(source: onnx.ModelProto, plan: LoraPlan, values: dict[str, np.ndarray], merge: bool) -> onnx.ModelProto:
    """The base ``source`` with the adapters of ``values`` (removed from it) merged into its weights
    (``merge``) or injected beside them as the plan says: the inference model before the other trained values
    are written back."""
    adapters = {name: values.pop(name) for name in plan.adapter_names}
    return merge_lora(source, adapters, plan) if merge else with_adapters(source, adapters, plan)


def inject_lora(model: onnx.ModelProto, rank: int = 8, alpha: float | None = None,
                targets: Iterable[str] | str = ("*",), seed: int = 0) -> tuple[onnx.ModelProto, LoraPlan]:
    """A copy of ``model`` with LoRA adapters beside each targeted Gemm/MatMul/Conv, and the plan.

    A node is targeted when a pattern of ``targets`` (fnmatch) matches its weight initializer's
    name or the node's name, and its weight (input 1) is a float initializer, directly or through a
    2-d Transpose (the legacy exporter's Linear). Adapters are initializers named ``<weight>.lora_A``
    / ``<weight>.lora_B``; the base node's output is renamed ``<output>.lora_base`` and an Add
    writes the original name, so every consumer sees base + adapter.
    """
    options = {"rank": rank, "targets": targets, "seed": seed, **({} if alpha is None else {"alpha": alpha})}
    rank, alpha, patterns, seed = check_lora_options(options)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    initializers = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {o for n in graph.node for o in n.output}
    rng = np.random.default_rng(seed)
    adapters: list[LoraAdapter] = []
    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        new_nodes.append(node)
        if node.op_type not in OPS or len(node.input) < 2:
            continue
        found = _weight(node, initializers, producers)
        if found is None:
            continue
        weight_name, transposed = found
        if not any(fnmatch.fnmatchcase(weight_name, p) or fnmatch.fnmatchcase(node.name, p) for p in patterns):
            continue
        weight = numpy_helper.to_array(initializers[weight_name])
        if weight.dtype.kind != "f":
            continue
        label = node.name or f"{node.op_type}_{index}"
        stem = _free(weight_name, taken)
        a_name, b_name = f"{stem}.lora_A", f"{stem}.lora_B"
        taken |= {a_name, b_name}
        adapter, a, b, nodes = _adapter(node, label, weight_name, weight, transposed, rank, alpha, a_name, b_name,
                                        taken, rng)
        adapters.append(adapter)
        graph.initializer.extend([numpy_helper.from_array(a, a_name), numpy_helper.from_array(b, b_name)])
        new_nodes.extend(nodes)
    if not adapters:
        raise InvalidOptionError(f"lora targets {list(patterns)} match no Gemm/MatMul/Conv with an initializer "
                                 f"weight; give patterns that match some of {_candidates(model)}")
    del graph.node[:]
    graph.node.extend(new_nodes)
    return result, LoraPlan(rank, alpha, patterns, tuple(adapters))


def _weight(node: onnx.NodeProto, initializers, producers) -> tuple[str, bool] | None:
    """The initializer behind ``node``'s weight input and whether a 2-d Transpose sits between them."""
    name = node.input[1]
    if name in initializers:
        return name, False
    producer = producers.get(name)
    if producer is not None and producer.op_type == "Transpose" and producer.input[0] in initializers:
        dims = list(initializers[producer.input[0]].dims)
        perm = [list(a.ints) for a in producer.attribute if a.name == "perm"]
        if len(dims) == 2 and (not perm or perm[0] == [1, 0]):
            return producer.input[0], True
    return None


def _free(stem: str, taken: set[str]) -> str:
    """``stem``, or ``stem.<i>`` when adapters of that name exist (a weight shared by targeted nodes)."""
    name, i = stem, 1
    while f"{name}.lora_A" in taken or f"{name}.lora_B" in taken:
        name, i = f"{stem}.{i}", i + 1
    return name


def _init_a(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    """peft's lora_A init: torch.nn.init.kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    fan_in = int(np.prod(shape[1:]))
    bound = 1.0 / math.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(dtype)


def _adapter(node, label, weight_name, weight, transposed, rank, alpha, a_name, b_name, taken, rng):
    """The adapter of one node: (LoraAdapter, A, B, the nodes that compute base + scale * B(A(x)))."""
    scale = alpha / rank
    out = node.output[0]
    base = fresh_name(f"{out}.lora_base", taken, ".")
    names = iter(fresh_name(f"{out}.lora_{s}", taken, ".") for s in ("xt", "at", "down", "bt", "up", "scale", "scaled"))
    x = node.input[0]
    nodes = []
    if node.op_type == "Conv":
        if weight.ndim < 3:
            raise LoraError(f"Conv '{label}': weight '{node.input[1]}' has rank {weight.ndim}; LoRA needs [out, in, *kernel]")
        if attribute(node, "group", 1) != 1:
            raise LoraError(f"Conv '{label}' has group={attribute(node, 'group', 1)}: LoRA supports group=1 only "
                            "(leave this node out of lora targets)")
        out_f, in_f, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
        a = _init_a(rng, (rank, in_f, *kernel), weight.dtype)
        b = np.zeros((out_f, rank, *[1] * len(kernel)), weight.dtype)
        layout = "out_in"
        kept = [attr for attr in node.attribute if attr.name in ("strides", "pads", "dilations", "auto_pad")]
        down = next(names)
        conv_a = helper.make_node("Conv", [x, a_name], [down], name=f"{label}.lora_A")
        conv_a.attribute.extend(kept)
        up = next(names)
        nodes += [conv_a, helper.make_node("Conv", [down, b_name], [up], name=f"{label}.lora_B")]
    else:
        if weight.ndim != 2:
            raise LoraError(f"{node.op_type} '{label}': weight '{node.input[1]}' has rank {weight.ndim}; LoRA needs 2-d")
        if node.op_type == "Gemm":
            trans_b = attribute(node, "transB", 0)
            layout = "out_in" if trans_b else "in_out"
            scale *= float(attribute(node, "alpha", 1.0))
            if attribute(node, "transA", 0):
                xt = next(names)
                nodes.append(helper.make_node("Transpose", [x], [xt], name=f"{label}.lora_xT"))
                x = xt
        else:
            layout = "out_in" if transposed else "in_out"
        if node.op_type == "Gemm" and transposed:
            layout = "in_out" if layout == "out_in" else "out_in"
        out_f, in_f = weight.shape if layout == "out_in" else weight.shape[::-1]
        a = _init_a(rng, (rank, in_f), weight.dtype)
        b = np.zeros((out_f, rank), weight.dtype)
        at, bt = next(names), next(names)
        down, up = next(names), next(names)
        nodes += [helper.make_node("Transpose", [a_name], [at], name=f"{label}.lora_AT"),
                  helper.make_node("MatMul", [x, at], [down], name=f"{label}.lora_A"),
                  helper.make_node("Transpose", [b_name], [bt], name=f"{label}.lora_BT"),
                  helper.make_node("MatMul", [down, bt], [up], name=f"{label}.lora_B")]
    factor, scaled = next(names), next(names)
    nodes += [helper.make_node("Constant", [], [factor], name=f"{label}.lora_scale",
                               value=numpy_helper.from_array(np.array(scale, weight.dtype))),
              helper.make_node("Mul", [up, factor], [scaled], name=f"{label}.lora_mul")]
    node.output[0] = base
    nodes.append(helper.make_node("Add", [base, scaled], [out], name=f"{label}.lora_add"))
    adapter = LoraAdapter(a_name, b_name, weight_name, label, node.op_type, layout, scale)
    return adapter, a, b, nodes


def _candidates(model: onnx.ModelProto) -> list[str]:
    """The weights that lora targets could match (for the message of a pattern that matches none)."""
    initializers = {t.name: t for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    found = (_weight(node, initializers, producers) for node in model.graph.node
             if node.op_type in OPS and len(node.input) > 1)
    return [f[0] for f in found if f is not None]


def lora_delta(adapter: LoraAdapter, a: np.ndarray, b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``scale * B @ A`` in the layout of the base weight (shape ``shape``)."""
    delta = adapter.scale * (b.reshape(b.shape[0], -1).astype(np.float64) @ a.reshape(a.shape[0], -1).astype(np.float64))
    if adapter.layout == "in_out":
        delta = delta.T
    return delta.reshape(shape)


def merge_lora(model: onnx.ModelProto, adapters: Mapping[str, np.ndarray], plan: LoraPlan) -> onnx.ModelProto:
    """A copy of ``model`` (the base model, before ``inject_lora``) with each adapter folded into its
    weight: ``W + scale * B @ A``. Refuses a weight that other nodes read too (a tied embedding): folding
    would change them."""
    missing = [name for name in plan.adapter_names if name not in adapters]
    if missing:
        raise InvalidOptionError(f"merge_lora: adapters {missing} are missing; pass every tensor of plan.adapter_names "
                                 "(a session's .state has them)")
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    initializers = {t.name: t for t in graph.initializer}
    present = sorted(set(plan.adapter_names) & set(initializers))
    if present:
        raise LoraError(f"merge_lora: the model already holds adapters {present[:4]}; pass the base model "
                        "(the one given to inject_lora), not the injected one")
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name or node.op_type)
    deltas: dict[str, np.ndarray] = {}
    for adapter in plan.adapters:
        if adapter.weight not in initializers:
            raise LoraError(f"merge_lora: weight '{adapter.weight}' of adapter '{adapter.a}' is not an initializer of "
                            "this model; pass the base model the plan was made for")
        users = readers.get(adapter.weight, [])
        transposes = [n for n in graph.node if n.op_type == "Transpose" and adapter.weight in n.input]
        users += [u for t in transposes for u in readers.get(t.output[0], [])]
        if len(users) != 1 + len(transposes):
            raise LoraError(f"merge_lora: weight '{adapter.weight}' is read by {users}, not only by node "
                            f"'{adapter.node}': folding its adapter in would change the others; export the base "
                            "model and the adapters separately (save_adapters) instead")
        weight = numpy_helper.to_array(initializers[adapter.weight])
        delta = lora_delta(adapter, np.asarray(adapters[adapter.a]), np.asarray(adapters[adapter.b]), weight.shape)
        deltas[adapter.weight] = deltas.get(adapter.weight, 0) + delta
    for name, delta in deltas.items():
        weight = numpy_helper.to_array(initializers[name])
        initializers[name].CopyFrom(numpy_helper.from_array((weight.astype(np.float64) + delta).astype(weight.dtype), name))
    return result


def save_adapters(path: str | os.PathLike, adapters: Mapping[str, np.ndarray], plan: LoraPlan) -> None:
    """Write only the adapters (``plan.adapter_names`` of ``adapters``, e.g. a session's ``.state``) and the plan
    as one ``.npz``: with the untouched base model, all that is needed to merge or inject them again."""
    missing = [name for name in plan.adapter_names if name not in adapters]
    if missing:
        raise InvalidOptionError(f"save_adapters: adapters {missing} are missing from the state")
    with open(path, "wb") as file:
        np.savez(file, **{name: np.asarray(adapters[name]) for name in plan.adapter_names},
                 **{PLAN_KEY: np.array(plan.to_json())})


def load_adapters(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], LoraPlan]:
    """The adapters and plan that ``save_adapters`` wrote."""
    with np.load(path, allow_pickle=False) as data:
        if PLAN_KEY not in data:
            raise LoraError(f"{os.fspath(path)} holds no LoRA plan ('{PLAN_KEY}'); write it with save_adapters")
        plan = LoraPlan.from_json(str(data[PLAN_KEY]))
        return {name: data[name] for name in plan.adapter_names}, plan


def with_adapters(model: onnx.ModelProto, adapters: Mapping[str, np.ndarray], plan: LoraPlan) -> onnx.ModelProto:
    """The base ``model`` injected again as ``plan`` says, with the trained ``adapters`` as its adapter
    initializers (the unmerged inference model)."""
    injected, again = inject_lora(model, plan.rank, plan.alpha, plan.targets)
    if [a.a for a in again.adapters] != [a.a for a in plan.adapters]:
        raise LoraError("with_adapters: this model's targeted weights differ from the plan's; pass its base model")
    for tensor in injected.graph.initializer:
        if tensor.name in adapters:
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(adapters[tensor.name]).astype(
                numpy_helper.to_array(tensor).dtype), tensor.name))
    return injected
