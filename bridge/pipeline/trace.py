"""Stage 3, trace: one training step -> one joint FX graph of ATen ops.

The step is a pure function (forward through the ONNX program, loss,
``torch.autograd.grad``, optimizer update) traced with ``make_fx``. The decomposition
table of ``bridge.pipeline.lowering`` is applied while tracing, so backward ops that have no ONNX
form (convolution_backward, pooling backward, ...) arrive already rewritten into ops that do.

Every traced node carries ``node.meta["custom"] = {"phase": ..., "layer": ...}``:
forward nodes get the ONNX node they come from; backward nodes get it through autograd
pre-hooks that map each grad_fn's sequence number back to the ONNX node whose forward
created it (the mechanism AOTAutograd uses for its stack traces).
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import onnx
import sympy
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._guards import SLoc
from torch._subclasses import fake_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ..contract import (
    DIM_BOUNDS,
    DIM_NAMES,
    GROWTH_TRACKER,
    LOSS,
    LOSS_LAYER,
    LOSS_SCALE,
    LR,
    STEP,
    TARGET,
    UPDATED_PREFIX,
    Phase,
    StepSignature,
    output_name,
    slot_name,
    strip_prefix,
    updated_name,
)
from ..errors import LoweringError, ShapeError
from .cse import eliminate_common_subexpressions, eliminate_dead_code
from .fold import fold_constants
from .importer.program import OnnxProgram
from .importer.weights import autograd_nodes
from .losses import Loss
from .lowering import LOWERINGS, decomposition_table
from .mixed_precision import Precision, autocast, found_nonfinite, keep_if, unscale, update_scale
from .optimizers import Optimizer, clip_grad_norm
from .replay import BlockReplay, Replay, Unkeyable, fake_of
from .replay import key as replay_key


class _LayerTags:
    """Tags traced nodes with their phase and source layer (see module docstring), and stops at
    the ONNX node that fixes a symbolic dim (see ``forward``)."""

    def __init__(self, dim_names: Mapping[sympy.Symbol, str] | None = None):
        self.dim_names = dict(dim_names or {})
        self.sizes: list[tuple[str, torch.SymInt]] = []  # (dim name, size) of the symbolic dims of the data
        self._starts: list[int] = []
        self._layers: list[str] = []

    def watch(self, data) -> None:
        """Watch the symbolic dims of the data tensors (inputs, noise, target) of this trace."""
        self.sizes = [(self.dim_names.get(size.node.expr, str(size.node.expr)), size)
                      for tensor in data for size in tensor.shape
                      if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol)]

    def _annotate(self, phase: str, layer: str, kind: str) -> dict:
        return {"phase": phase, "layer": layer, "kind": kind}

    @contextlib.contextmanager
    def forward(self, node: onnx.NodeProto):
        self._record(node.name, node.op_type)
        with fx_traceback.annotate(self._annotate(Phase.FORWARD, node.name, node.op_type)):
            try:
                yield
            except RuntimeError as exc:  # e.g. a symbolic length broadcast against a constant table
                if not self.sizes:
                    raise
                raise ShapeError(f"{node.op_type} node '{node.name}' fails at a symbolic size ({exc}); "
                                 f"{_KEEP_STATIC}") from exc
        self.check_symbolic(f"{node.op_type} node '{node.name}'")

    def check_symbolic(self, where: str) -> None:
        """Raise if a watched symbolic size has become a number (tracing specialised it)."""
        fixed = [(name, size.node.expr) for name, size in self.sizes if size.node.expr.is_number]
        if fixed:
            name, value = fixed[0]
            raise ShapeError(
                f"{where} fixes the {name} size to {value} (a hard-coded shape, or an op that bridge unrolls "
                f"over that dim, such as an RNN over time); this model cannot train at any {name} size: {_KEEP_STATIC}"
            )

    @contextlib.contextmanager
    def scope(self, phase: str, layer: str, kind: str):
        if phase == Phase.LOSS:
            self._record(layer, kind)
        with fx_traceback.annotate(self._annotate(phase, layer, kind)):
            yield

    def _record(self, layer: str, kind: str) -> None:
        self._starts.append(torch.autograd._get_sequence_nr())
        self._layers.append(f"{kind}\0{layer}")

    def _layer_of(self, seq_nr: int) -> tuple[str, str]:
        index = bisect.bisect_right(self._starts, seq_nr) - 1
        if index < 0:
            return "", ""
        kind, layer = self._layers[index].split("\0")
        return layer, kind

    def hook_backward(self, root: torch.Tensor) -> None:
        """Register pre-hooks so nodes traced while a grad_fn runs carry its forward layer."""
        for fn in autograd_nodes(root):
            self.hook(fn)

    def hook(self, fn) -> None:
        """Register the pre-hook of one autograd node (``hook_backward``)."""
        layer, kind = self._layer_of(fn._sequence_nr())
        fn.register_prehook(self._enter(layer, kind))

    def _enter(self, layer: str, kind: str):
        def prehook(grad_outputs):
            fx_traceback.current_meta["custom"] = self._annotate(Phase.BACKWARD, layer, kind)

        return prehook


class _ShapeEnv(ShapeEnv):
    """torch's ``ShapeEnv`` without the source location it records for each symbol, range and guard: torch
    finds it by walking the stack past a list of its own files, and building that list imports torch.export,
    AOTAutograd and networkx on first use (most of a small model's dynamic-batch conversion). Those locations
    only feed torch's debug logs; bridge names the ONNX node that fixes a size itself (``_LayerTags``)."""

    def _get_stack_summary(self, is_debug: bool = False, framework_loc: str | None = None) -> tuple[SLoc, str]:
        return SLoc(framework_loc, None), ""


# What to do about a dim the model pins.
_KEEP_STATIC = ("keep that dim static (dynamic_dims= without it; for the batch, dynamic_batch=False), "
                "see docs/dynamic_batch.md")

DimSpec = Mapping[str, Mapping[int, str]]  # data input name -> {axis: dim name} of its symbolic dims


@dataclass(frozen=True)
class StepExample:
    """What a trace runs: the program and loss, the example state tensors by name, the example data inputs by
    name (noise inputs included), the example target, the model output the loss applies to and the symbolic
    dims of the data inputs (``DimSpec``)."""

    program: OnnxProgram
    loss: Loss
    tensors: dict[str, torch.Tensor]
    inputs: dict[str, torch.Tensor]
    target: torch.Tensor
    output_index: int
    dims: DimSpec | None = None
    precision: Precision = Precision()


def trace_training_step(example: StepExample, optimizer: Optimizer, signature: StepSignature,
                        max_grad_norm: float | None = None) -> torch.fx.GraphModule:
    """Trace forward + loss + backward + optimizer update into one FX graph.

    The traced function takes and returns ``signature``'s flat arguments and results
    (``StepSignature.unflatten`` / ``flatten``); its body is three passes: ``_forward_loss``,
    ``_backward``, ``_optimizer_update``.
    With ``example.dims`` the data inputs get those symbolic dims (one symbol per dim name), the noise
    inputs and the target the symbolic sizes that follow from them, and every size derived from
    them stays symbolic in the graph.
    With ``max_grad_norm`` the gradients are clipped by global norm before the update
    (the ``grad_*`` outputs stay the unclipped gradients of the loss).
    """
    def train_step(args: dict[str, torch.Tensor], tags: _LayerTags) -> dict[str, torch.Tensor]:
        weights = {name: args[name] for name in signature.weights}
        loss_value, outputs, updated_buffers = _forward_loss(example, signature, args, tags)
        grads = _backward(loss_value, list(weights.values()), tags, args.get(LOSS_SCALE))
        results = {LOSS: loss_value, **dict(zip(signature.gradient_names(), grads, strict=True))}
        results.update(_optimizer_update(optimizer, signature, args, grads, tags, max_grad_norm,
                                         example.precision.grad_scaler))
        results.update({updated_name(name): updated_buffers.get(name, args[name]) for name in signature.buffers})
        results.update(_extra_outputs(example.program, signature, outputs))
        return results

    return _trace_step(example, signature, train_step)


def _trace_step(example: StepExample, signature: StepSignature,
                body: Callable[[dict[str, torch.Tensor], _LayerTags], dict[str, torch.Tensor]]) -> torch.fx.GraphModule:
    """Trace ``body(args, tags)``, a step from its arguments by name to its results by name, as a function of
    ``signature``'s flat arguments and results; ``tags`` watch the data arguments (``_LayerTags``)."""
    data, dim_names, bounds = _data_args(example, signature)
    tags = _LayerTags(dim_names)

    def step(*flat):
        args = signature.unflatten(flat)
        tags.watch([args[name] for name in signature.data_names()])
        return tuple(signature.flatten(body(args, tags), outputs=True))

    return _trace(step, _state_args(signature, example.tensors), data, dim_names, bounds)


def _state_args(signature: StepSignature, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The example state arguments of a trace (``signature.state_names()``), detached; in the
    training step the weights require grad (the backward differentiates with respect to them)."""
    weights = set(signature.weights) if signature.training else set()
    return [tensors[name].detach().requires_grad_(name in weights) for name in signature.state_names()]


def _forward_loss(example: StepExample, signature: StepSignature, args: dict[str, torch.Tensor],
                  tags: _LayerTags) -> tuple[torch.Tensor, list, dict]:
    """Pass 1: the ONNX program on the step's arguments (forward phase, each op tagged with its
    ONNX node; in inference mode for the eval signature), then the loss of output ``example.output_index``
    (loss phase), both under torch's autocast for mixed precision (``example.precision``). Returns the loss, the
    model outputs and the buffers the forward updated (BatchNorm statistics in training mode). The training step
    at static sizes in float32 traces each repeated block of the model once (``BlockReplay``)."""
    replay = signature.training and not example.dims and example.precision.dtype is None
    with autocast(example.precision):
        outputs, updated_buffers = example.program.run(
            {name: args[name] for name in signature.inputs},
            {name: args[name] for name in signature.weights + signature.buffers},
            training=signature.training, node_scope=tags.forward,
            random={name: args[name] for name in signature.random}, evaluation=not signature.training,
            blocks=BlockReplay(tags.hook) if replay else None,
        )
        with tags.scope(Phase.LOSS, LOSS_LAYER, example.loss.name):
            loss_value = _float32(example.loss(outputs[example.output_index], args[TARGET]))
    return loss_value, outputs, updated_buffers


def _backward(loss_value: torch.Tensor, weights: list[torch.Tensor], tags: _LayerTags,
              loss_scale: torch.Tensor | None = None) -> Sequence[torch.Tensor]:
    """Pass 2: the gradients of the loss with respect to ``weights`` (backward phase, each op tagged
    with the forward layer whose grad_fn runs it). With a ``loss_scale`` (mixed precision), the gradients
    of the loss times the scale, unscaled."""
    if loss_scale is not None:
        with tags.scope(Phase.LOSS, LOSS_LAYER, LOSS_SCALE):
            loss_value = loss_value * loss_scale
    tags.hook_backward(loss_value)
    with fx_traceback.annotate({"phase": Phase.BACKWARD, "layer": "", "kind": ""}):
        grads = torch.autograd.grad(loss_value, weights, materialize_grads=True)
    tags.check_symbolic("the loss or the backward pass (a lowering of bridge.pipeline.lowering)")
    if loss_scale is None:
        return grads
    with fx_traceback.annotate({"phase": Phase.BACKWARD, "layer": LOSS_LAYER, "kind": LOSS_SCALE}):
        return unscale(grads, loss_scale)


def _optimizer_update(optimizer: Optimizer, signature: StepSignature, args: dict[str, torch.Tensor],
                      grads: Sequence[torch.Tensor], tags: _LayerTags,
                      max_grad_norm: float | None, grad_scaler: dict | None = None) -> dict[str, torch.Tensor]:
    """Pass 3: ``step + 1``, global-norm clipping (``max_grad_norm``), then each weight's update
    (optimizer phase, layer = the weight). Returns ``updated_*`` of the weights, optimizer state
    and step. With loss scaling (``grad_scaler``: GradScaler's options), a non-finite gradient skips the
    update (every weight, slot and ``step`` kept) and the loss scale state is updated."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for weight, slot in signature.state:
        state.setdefault(weight, {})[slot] = args[slot_name(weight, slot)]
    with tags.scope(Phase.OPTIMIZER, STEP, optimizer.name):
        new_step = args[STEP] + 1
    updates = grads
    if max_grad_norm is not None:
        with tags.scope(Phase.OPTIMIZER, "global", "clip_grad_norm"):
            updates = clip_grad_norm(grads, max_grad_norm)
    results = {}
    replay = _UpdateReplay(optimizer)
    for name, grad in zip(signature.weights, updates, strict=True):
        with tags.scope(Phase.OPTIMIZER, name, optimizer.name):
            new_param, new_slots = replay.update(args[name], grad, state.get(name, {}), new_step, args[LR])
        results[updated_name(name)] = new_param
        results.update({updated_name(slot_name(name, slot)): new_slots[slot]
                        for w, slot in signature.state if w == name})
    results[updated_name(STEP)] = new_step
    if grad_scaler is None:
        return results
    with tags.scope(Phase.OPTIMIZER, LOSS_SCALE, LOSS_SCALE):
        skipped = found_nonfinite(grads)
        kept = {name: keep_if(skipped, args[strip_prefix(name, UPDATED_PREFIX)], value) for name, value in results.items()}
        kept[updated_name(LOSS_SCALE)], kept[updated_name(GROWTH_TRACKER)] = update_scale(
            args[LOSS_SCALE], args[GROWTH_TRACKER], skipped, grad_scaler)
    return kept


class _UpdateReplay:
    """``optimizer.update`` traced once per kind of weight (dtype and state slots; the shape too where the update
    is not elementwise) and replayed for the other weights of that kind (``bridge.pipeline.replay.Replay.run_pointwise``:
    an update is tens of ops per weight). Outside tracing it is ``optimizer.update``."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self._replay = Replay()

    def update(self, param: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], step: torch.Tensor,
               lr: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self._replay.run_pointwise(tuple(slots), [param, grad, *slots.values(), step, lr],
                                          lambda: self.optimizer.update(param, grad, slots, step, lr))


class _LoweringReplay:
    """bridge's lowerings (``bridge.pipeline.lowering``) traced once per call signature (op, argument values, tensor
    shapes, strides and dtypes: ``bridge.pipeline.replay.key``) and replayed for the other calls with that signature
    (``bridge.pipeline.replay.Replay``): a network's convolution backwards repeat few signatures, each lowered into
    tens of ops. A call with an argument ``bridge.pipeline.replay.key`` does not know is traced."""

    def __init__(self):
        self._replay = Replay()

    def table(self) -> dict:
        """``decomposition_table()`` with each of bridge's lowerings replayed."""
        table = decomposition_table()
        for op in LOWERINGS:
            table[op] = functools.partial(self._lower, op, table[op])
        return table

    def _lower(self, op: torch._ops.OpOverload, lowering: Callable, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        try:
            signature = tuple(replay_key(leaf) for leaf in leaves)
        except Unkeyable:
            return lowering(*args, **kwargs)
        return self._replay.run((op, spec, signature), [x for x in leaves if isinstance(x, torch.Tensor)],
                                lambda: lowering(*args, **kwargs))


def _extra_outputs(program: OnnxProgram, signature: StepSignature, outputs: list) -> dict[str, torch.Tensor]:
    """``output_<name>`` for the model outputs the step also returns (``signature.outputs``); one that mixed
    precision computed in float16/bfloat16 is returned as float32, the type of the source model's output."""
    return {output_name(name): _float32(outputs[program.output_names.index(name)]) for name in signature.outputs}


def _float32(value: torch.Tensor) -> torch.Tensor:
    """``value`` as float32 if autocast made it float16 or bfloat16 (numpy has no bfloat16 for the runtimes)."""
    return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value


def split_step(graph_module: torch.fx.GraphModule,
               signature: StepSignature) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The traced step cut at its gradients (no second trace): the gradient half (forward, loss,
    backward -> ``signature.split()[0]``'s outputs) and the update half (clipping, optimizer, whose
    ``grad_*`` nodes become inputs). Both copy the step's own nodes, tags included, so running one
    after the other computes exactly what the step computes."""
    gradient_signature, update_signature = signature.split()
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    inputs = signature.unflatten(placeholders)
    (output,) = (node for node in graph_module.graph.nodes if node.op == "output")
    results = signature.unflatten(output.args[0], outputs=True)
    gradient = _subgraph(graph_module, [inputs[name] for name in gradient_signature.input_names()],
                         [results[name] for name in gradient_signature.output_names()], "gradient")
    boundary = ([inputs[name] for name in update_signature.state_names()]
                + [results[name] for name in update_signature.gradient_names()])
    update = _subgraph(graph_module, boundary, [results[name] for name in update_signature.output_names()], "update")
    return gradient, update


def _subgraph(graph_module: torch.fx.GraphModule, boundary: list[torch.fx.Node], outputs: list[torch.fx.Node],
              part: str) -> torch.fx.GraphModule:
    """A graph of the nodes of ``graph_module`` that ``outputs`` need, reading ``boundary`` (in this
    order) as its placeholders."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    taken: set[str] = set()
    for node in boundary:  # one value may stand at two places (x + y: grad_x and grad_y are one node)
        name = node.name if node.op == "placeholder" else f"{node.name}_input"
        while name in taken:
            name += "_"
        taken.add(name)
        placeholder = graph.placeholder(name)
        placeholder.meta = dict(node.meta)
        env.setdefault(node, placeholder)
    needed, stack = set(), [node for node in outputs if node not in env]
    while stack:
        node = stack.pop()
        if node in needed or node in env:
            continue
        if node.op == "placeholder":
            raise LoweringError(f"the {part} half of the step reads the step input '{node.name}', which is "
                                "not one of its inputs: the step cannot be split at its gradients")
        needed.add(node)
        stack.extend(node.all_input_nodes)
    for node in graph_module.graph.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[node] for node in outputs))
    with _use_lazy_graph_module(True):
        result = _make_graph_module(graph_module, graph)
    for key in (DIM_NAMES, DIM_BOUNDS):
        result.meta[key] = graph_module.meta.get(key, {})
    return result


def trace_eval_step(example: StepExample, signature: StepSignature) -> torch.fx.GraphModule:
    """Trace the eval step (``signature.training`` is False): the forward in inference mode
    (BatchNorm with its running statistics, Dropout off) and the loss; returns the loss and
    the model outputs named in ``signature.outputs``."""
    def eval_step(args: dict[str, torch.Tensor], tags: _LayerTags) -> dict[str, torch.Tensor]:
        loss_value, outputs, _ = _forward_loss(example, signature, args, tags)
        return {LOSS: loss_value, **_extra_outputs(example.program, signature, outputs)}

    return _trace_step(example, signature, eval_step)


def _trace(step, flat_args: list[torch.Tensor], data: list[torch.Tensor], dim_names: dict[sympy.Symbol, str],
           bounds: dict[str, int]) -> torch.fx.GraphModule:
    """``make_fx`` of ``step`` on ``flat_args`` + ``data`` with the lowering table; symbolic when
    ``data`` are fake tensors with symbolic dims (``_data_args``), whose names the graph module
    keeps in ``meta[DIM_NAMES]``, with ``bounds`` in ``meta[DIM_BOUNDS]``. Values no output needs are dropped.

    Traced on fake tensors (``tracing_mode="fake"`` for static shapes): no arithmetic runs, so the time does
    not grow with the data's size, and the graph is the one a real-mode trace records (bridge's converters
    never read tensor values). The graph module is lazy: its Python code is generated on its first call, not
    at every recompile (the exporter only walks the graph)."""
    fake_mode = next((t.fake_mode for t in data if isinstance(t, FakeTensor)), None)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True)
        data = [fake_mode.from_tensor(t, static_shapes=True) for t in data]
    flat_args = [fake_of(fake_mode, t) for t in flat_args] + list(data)
    mode = "symbolic" if fake_mode.shape_env is not None else "fake"
    with fx_traceback.preserve_node_meta(), _use_lazy_graph_module(True), static_views_on_meta_kernels():
        graph_module = _make_fx(step, _LoweringReplay().table(), mode)(*flat_args)
    fold_constants(graph_module)
    # drop values no output needs (e.g. max pooling's Indices, which the lowered backward never reads)
    eliminate_dead_code(graph_module.graph)
    eliminate_common_subexpressions(graph_module.graph)
    graph_module.recompile()
    graph_module.meta[DIM_NAMES] = dim_names
    graph_module.meta[DIM_BOUNDS] = bounds
    return graph_module


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


@contextlib.contextmanager
def static_views_on_meta_kernels():
    """Within it, a view of a contiguous fake tensor at static shapes (a fake mode without a shape environment) is
    made by ATen's C++ meta kernel instead of fake tensors' Python rule, which reshapes through prims to serve
    symbolic sizes and runs for every view shape new to the process; the view is the same.
    Other views (symbolic, strided, or not of the tensor's size) keep torch's rule and its errors."""
    rules = fake_impls.op_implementations_dict
    saved = {op: rules[op] for op in _VIEWS}

    def view(fake_mode: FakeTensorMode, func, tensor: torch.Tensor, size: Sequence[int], **kwargs):
        if fake_mode.shape_env is None and tensor.is_contiguous() and _fits(size, tensor.numel()):
            return NotImplemented  # fake tensors then run the op's meta kernel, which cannot fail here
        return saved[func](fake_mode, func, tensor, size, **kwargs)

    rules.update(dict.fromkeys(_VIEWS, view))
    try:
        yield
    finally:
        rules.update(saved)


def _fits(size: Sequence[int], numel: int) -> bool:
    """Whether ``size`` (at most one -1, inferred) holds exactly ``numel`` elements."""
    if any(s < -1 for s in size) or list(size).count(-1) > 1:
        return False
    known = math.prod(s for s in size if s != -1)
    return known == numel if -1 not in size else known > 0 and numel % known == 0


def _make_fx(fn: Callable, table: dict, mode: str) -> Callable[..., torch.fx.GraphModule]:
    """``make_fx`` of ``fn`` with the decomposition ``table`` in tracing ``mode``, without its torch-function
    metadata mode: that mode intercepts every torch call to name the calls in a ``torch_fn`` meta that only the
    module-stack tracer writes (``record_module_stack``, not used here), and turns an explicit
    ``torch.ops.aten.size.default`` call at symbolic sizes into ``sym_size`` (bridge makes none); the graphs are
    the same without it."""
    return make_fx(fn, decomposition_table=table, tracing_mode=mode, _disable_torch_fn_metadata_mode=True)


def _upper_bounds(shape_env: ShapeEnv, dim_names: Mapping[sympy.Symbol, str]) -> dict[str, int]:
    """The largest size of each named dim that the traced graph holds for, where the model bounds
    it (a sequence length slicing a position table of 32 rows: 32)."""
    bounds: dict[str, int] = {}
    for symbol, name in dim_names.items():
        upper = shape_env.var_to_range[symbol].upper if symbol in shape_env.var_to_range else None
        if isinstance(upper, sympy.Integer):
            bounds[name] = min(bounds.get(name, int(upper)), int(upper))
    return bounds


def _data_args(example: StepExample, signature: StepSignature) -> tuple[list[torch.Tensor], dict, dict]:
    """The data arguments of a trace of ``signature`` (inputs, noise, target) and the names of their symbols.

    Without ``dims``: the example tensors themselves. With ``dims``: fake tensors whose dims
    named there are symbolic, one fresh symbol per dim (no duck sizing: two dims of equal example
    size stay two symbols until the model itself equates them). The noise inputs and the target
    get their symbolic shapes from a forward pass on those fakes (a noise input of a Dropout on
    ``[batch, heads, seq, seq]`` activations, a target ``[batch, seq]``)."""
    program, loss, dims, training = example.program, example.loss, example.dims, signature.training
    inputs = {name: example.inputs[name] for name in signature.inputs}
    random = {name: example.inputs[name] for name in signature.random}
    if not dims:
        return [*inputs.values(), *random.values(), example.target], {}, {}
    fake_mode = FakeTensorMode(shape_env=_ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    fakes, dim_names = {}, {}
    for name, tensor in inputs.items():
        axes = {axis % max(tensor.dim(), 1): dim for axis, dim in dims.get(name, {}).items()}
        sizes = [DimDynamic.DYNAMIC if axis in axes else DimDynamic.STATIC for axis in range(tensor.dim())]
        fakes[name] = fake_mode.from_tensor(tensor, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))
        for axis, dim in axes.items():
            expr = fakes[name].shape[axis]
            if not isinstance(expr, torch.SymInt):
                raise ShapeError(f"dim {axis} ('{dim}') of input '{name}' has size {expr} in the example, which "
                                 "tracing fixes (sizes 0 and 1 are specialised): trace at a size of 2 or more "
                                 "(input_shapes=)")
            dim_names.setdefault(expr.node.expr, dim)
    tags = _LayerTags(dim_names)

    def forward(*data):
        tags.watch(data)
        drawn: dict[str, torch.Tensor] = {}
        outputs, _ = program.run(dict(zip(fakes, data, strict=True)), example.tensors, training=training, node_scope=tags.forward,
                                 random=drawn, evaluation=not training)
        return (outputs[example.output_index], *(drawn[name] for name in random))

    # traced as the step will be (with the lowering table), so that it specialises exactly what the step would
    with torch.no_grad():
        graph = _make_fx(forward, decomposition_table(), "symbolic")(*fakes.values())
    output, *noise = (node.meta["val"] for node in graph.graph.find_nodes(op="output")[0].args[0])
    spec = loss.target_spec(output)
    with fake_mode:
        fake_target = torch.empty(spec.shape, dtype=spec.dtype)
    noise = [value.to(random[name].dtype) for name, value in zip(random, noise, strict=True)]
    # The batch dims are never bounded: tracing a Conv guards ``batch < 16`` (a kernel-choice
    # heuristic of torch's, no limit of the ONNX graph), which would refuse every larger batch.
    batch_dims = {axes[0] for axes in dims.values() if 0 in axes}
    bounds = {name: size for name, size in _upper_bounds(fake_mode.shape_env, dim_names).items()
              if name not in batch_dims}
    return [*fakes.values(), *noise, fake_target], dim_names, bounds
