"""Stage 3, trace: regions of a ``make_fx`` trace recorded once and replayed.

A region (an optimizer update, a lowering, a BatchNorm's forward or backward) traced once per key and copied for
later calls with that key, with the call's own inputs and tags (names as tracing gives them): the graph is the one
tracing every call records, without tracing each op again. ``key`` makes the keys (typed, hashable values of a
call's arguments); ``replayed`` replays a function of tensors within the running trace, for code outside
``bridge.pipeline.trace`` (the importer's converters), and in a fake-tensor run outside tracing gives later calls with a
key fresh tensors of the first call's result layout.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot, track_tensor_tree
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import LoweringError


class Replay:
    """Regions of a ``make_fx`` trace recorded once per key and replayed for later calls with that key (module
    docstring). A constant the region captured (a ``get_attr`` node, e.g. a lowering's selection matrix) is captured
    again by each replay, under a fresh attribute as tracing gives it. Outside tracing, and for a region that reads a
    value it was not given, ``fn`` simply runs."""

    def __init__(self):
        self._recorded: dict[object, tuple[list[torch.fx.Node], list[torch.fx.Node], list, object]] = {}
        self._pointwise: dict[object, bool] = {}  # run_pointwise's keys: whether the recorded region is elementwise

    def run(self, key: object, tensors: Sequence[torch.Tensor], fn: Callable[[], object]) -> object:
        """``fn()``, a function of ``tensors`` whose result is a pytree of tensors (None leaves allowed),
        traced the first time ``key`` is seen and replayed for ``tensors`` after that."""
        mode = get_proxy_mode()
        inputs = [] if mode is None else [_node_of(t, mode.tracer) for t in tensors]
        if mode is None or None in inputs or len(set(inputs)) < len(inputs):
            return fn()
        if key in self._recorded:
            return self._replay(mode.tracer, self._recorded[key], dict(zip(inputs, tensors, strict=True)), inputs)
        graph = mode.tracer.graph
        last = graph._root.prev
        result = fn()
        nodes, node = [], last.next
        while node is not graph._root:
            nodes.append(node)
            node = node.next
        leaves, spec = pytree.tree_flatten(result)
        if all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in leaves):
            outputs = [None if leaf is None else _node_of(leaf, mode.tracer) for leaf in leaves]
            if (all(out is None or out in nodes or out in inputs for out in outputs)
                    and all(n.op in ("call_function", "get_attr") for n in nodes)):
                self._recorded[key] = (inputs, nodes, outputs, spec)
        return result

    def run_pointwise(self, key: object, tensors: Sequence[torch.Tensor], fn: Callable[[], object]) -> object:
        """``run`` for a region of elementwise arithmetic over tensors of one shape and 0-d scalars (an optimizer
        update), recorded once per ``key`` and layout whatever that shape is, and replayed at the shape of the
        call: each copied value of the recorded shape gets the call's, in the order of its dims in memory that it
        had (``_order``: a weight gradient may be a permuted view). ``key`` must not hold the shape; it is added
        to the key (``run``) where the region, or a call, is anything else (a reduction, a view, a value of a third
        shape, a tensor neither contiguous nor a dense permutation of a shape without unit dims, a symbolic size)."""
        full = next((t.shape for t in tensors if t.dim()), None)
        layout = tuple(_pointwise_layout(t, full) for t in tensors)
        shaped = (key, tuple(_shape_key(t) for t in tensors))
        if full is None or None in layout or any(isinstance(size, torch.SymInt) for size in full):
            return self.run(shaped, tensors, fn)
        generic = ("pointwise", key, layout)
        if self._pointwise.get(generic) is False:
            return self.run(shaped, tensors, fn)
        mode = get_proxy_mode()
        if generic in self._recorded and mode is not None:
            inputs = [_node_of(t, mode.tracer) for t in tensors]
            if None not in inputs and len(set(inputs)) == len(inputs):
                return self._replay(mode.tracer, self._recorded[generic], dict(zip(inputs, tensors, strict=True)),
                                    inputs, full)
        result = self.run(generic, tensors, fn)
        if generic in self._recorded and generic not in self._pointwise:
            self._pointwise[generic] = _elementwise(self._recorded[generic][1], full)
            if not self._pointwise[generic]:
                self._recorded[shaped] = self._recorded.pop(generic)
        return result

    @staticmethod
    def _replay(tracer, recorded: tuple, values: dict[torch.fx.Node, torch.Tensor],
                inputs: list[torch.fx.Node], shape: torch.Size | None = None) -> object:
        """Copy the ``recorded`` nodes reading ``inputs``; the copies of its outputs as tracked fake tensors.
        ``shape``: the call's shape for a pointwise region (``run_pointwise``), given to every value of the
        recorded shape."""
        template_inputs, nodes, outputs, spec = recorded
        recorded_shape = next((n.meta["val"].shape for n in template_inputs if n.meta["val"].dim()), None)
        resize = shape is not None and shape != recorded_shape
        env = dict(zip(template_inputs, inputs, strict=True))
        custom = dict(fx_traceback.current_meta.get("custom") or {})
        resized: dict[tuple, torch.Tensor] = {}  # a value of the call's shape per dtype, device and order of dims
        # in memory, shared by the copies (as the copies of a region replayed at its own shape share its values)
        for node in nodes:
            copy = env[node] = _copy_node(tracer, node, lambda n: env.get(n, n))
            if node.op == "get_attr":
                continue
            copy.meta = {**node.meta, "custom": custom}
            value = node.meta["val"]
            if resize and value.dim():
                layout = (value.dtype, value.device, None if value.is_contiguous() else _order(value))
                if layout not in resized:
                    with disable_proxy_modes_tracing():
                        resized[layout] = (torch.empty(shape, dtype=value.dtype, device=value.device) if layout[2] is None
                                           else torch.empty_permuted(shape, layout[2], dtype=value.dtype,
                                                                     device=value.device))
                copy.meta["val"] = resized[layout]
                copy.meta.pop("tensor_meta", None)
        results = []
        for out in outputs:
            if out is None or out in template_inputs:
                results.append(None if out is None else values[env[out]])
                continue
            result = _fresh_like(env[out].meta["val"])
            track_tensor_tree(result, torch.fx.Proxy(env[out], tracer), constant=None, tracer=tracer)
            results.append(result)
        return pytree.tree_unflatten(results, spec)


def _fresh_like(value: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(value)`` of a recorded value, outside the proxy mode; for a contiguous fake tensor of
    static sizes made directly (``_dense_fake``)."""
    if isinstance(value, FakeTensor) and value.layout == torch.strided and not _symbolic(value) \
            and value.is_contiguous():
        return _dense_fake(value.fake_mode, value.shape, value.stride(), value.dtype, value.device)
    with disable_proxy_modes_tracing():
        return torch.empty_like(value)


def fake_of(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a fake tensor of ``fake_mode`` at static sizes: a plain contiguous tensor (a weight, buffer or
    optimizer slot, each its own storage) as a ``_dense_fake`` of its layout with its ``requires_grad``, a small
    fraction of the cost of ``from_tensor``'s conversion, which also records views and storage sharing (such a
    tensor has none); any other tensor through ``from_tensor``."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.storage_offset() != 0 \
            or not tensor.is_contiguous() or tensor._base is not None:
        return fake_mode.from_tensor(tensor, static_shapes=True)
    return _dense_fake(fake_mode, tensor.shape, tensor.stride(), tensor.dtype, tensor.device).requires_grad_(
        tensor.requires_grad)


def _dense_fake(fake_mode: FakeTensorMode, shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
               device: torch.device) -> FakeTensor:
    """A fake tensor of ``fake_mode`` of this layout at storage offset 0, what ``torch.empty_strided`` makes in
    the mode, made without dispatching through it (nor through a running trace): a small fraction of the cost,
    for the hundreds a trace makes."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, device)


def _copy_node(tracer, node: torch.fx.Node, read: Callable[[torch.fx.Node], object]) -> torch.fx.Node:
    """A copy of recorded ``node`` in ``tracer``'s graph, its node arguments mapped by ``read``, without meta (the
    caller sets it); a ``get_attr`` is its value under a fresh attribute, as tracing the region again makes it."""
    if node.op == "get_attr":
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            value = getattr(tracer.root, node.target).detach()
        return tracer.create_arg(value)
    graph = tracer.graph
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", None) or node.name
    return graph.create_node(node.op, node.target, *torch.fx.node.map_arg((node.args, node.kwargs), read),
                             name=graph._target_to_str(name))


def _shape_key(tensor: torch.Tensor) -> tuple:
    """``key`` of a tensor (its sizes as given, symbolic or not)."""
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype, tensor.device


def _elementwise(nodes: list[torch.fx.Node], shape: torch.Size) -> bool:
    """Whether every node of a recorded region computes elementwise over ``shape`` (its values and operands laid
    out as ``_pointwise_layout`` keys) or on 0-d values only, so that a copy at another shape computes the same
    per element: a pointwise ATen op whose result has ``shape`` or is 0-d, or any ATen op whose tensor arguments
    and result are all 0-d."""
    for node in nodes:
        value = node.meta.get("val")
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or not isinstance(value, torch.Tensor)):
            return False
        arguments = [a.meta.get("val") for a in node.all_input_nodes]
        if not all(isinstance(a, torch.Tensor) for a in arguments):
            return False
        if value.dim() == 0 and all(a.dim() == 0 for a in arguments):
            continue
        if (torch.Tag.pointwise not in node.target.tags or not value.dim() or _pointwise_layout(value, shape) is None
                or any(a.dim() and _pointwise_layout(a, shape) is None for a in arguments)):
            return False
    return True


def _pointwise_layout(tensor: torch.Tensor, shape: torch.Size | None) -> tuple | None:
    """A tensor's part of a pointwise region's key (``Replay.run_pointwise``): 0-d or of ``shape``, its dtype and
    device, and for a non-contiguous one of ``shape``, its order of dims in memory; None for any other tensor.
    Non-contiguous only as a dense permutation of a shape without unit dims: an elementwise op's result then
    takes its order of dims from the order of its operands' (the comparisons of their strides), whatever the
    sizes, so a region replayed at another shape of that kind gives each value the order tracing gives it."""
    if not tensor.dim():
        return (False, tensor.dtype, tensor.device)
    if tensor.shape != shape:
        return None
    if tensor.is_contiguous():
        return (True, tensor.dtype, tensor.device)
    order = _order(tensor)
    if 1 in shape or tensor.stride() != _dense_strides(shape, order):
        return None
    return (True, tensor.dtype, tensor.device, order)


def _order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dims of a tensor from outermost to innermost in memory (``torch.empty_permuted``'s order) by its
    strides, for a tensor without unit dims."""
    return tuple(sorted(range(tensor.dim()), key=lambda dim: -tensor.stride()[dim]))


def _dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` laid out densely in ``order`` (outermost dim first)."""
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def _node_of(tensor: torch.Tensor, tracer) -> torch.fx.Node | None:
    """The FX node a tracked tensor is the value of (None for an untracked one)."""
    return get_proxy_slot(tensor, tracer, None, lambda p: p.proxy.node)


_REPLAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tracer -> its Replay of ``replayed``'s calls
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> {key: layout of fn's result}


def replayed(fn: Callable[..., object], *args, pointwise: bool = False) -> object:
    """``fn(*args)``, traced once per ``(fn, key of every argument)`` in the running trace and replayed after
    that (``Replay``); ``fn``'s result must depend on nothing but its arguments (and on a tensor argument only
    through what ``key`` keys). An argument ``key`` does not know, a symbolic size or a tensor of symbolic size:
    ``fn`` is traced. ``pointwise``: ``fn`` is elementwise over tensors of one shape (and 0-d tensors), traced once
    per key of its other arguments whatever that shape is and replayed at each call's shape
    (``Replay.run_pointwise``; traced once per shape where ``fn`` turns out not to be elementwise).
    Outside tracing, in a fake-tensor run (the conversion's example run, ``bridge.api._probe``), where a result
    is only its layout: ``fn`` runs once per key, later calls get fresh tensors of that layout (``_fake_run``).

    Not at symbolic sizes: a replay there reuses the size nodes of the first call, and which ones tracing shares
    depends on torch's fake-tensor cache, i.e. on what the process traced before: the graph would depend on
    the process's history."""
    mode = get_proxy_mode()
    fake = active_fake_mode() if mode is None else None
    if (mode is None and fake is None) or any(_symbolic(arg) for arg in args):
        return fn(*args)
    try:
        signature = tuple(key(arg) for arg in args)
    except Unkeyable:
        return fn(*args)
    if mode is None:
        return _fake_run(fake, _LAYOUTS.setdefault(fake, {}), (fn, signature), args, lambda: fn(*args))
    replay, tensors = _REPLAYS.setdefault(mode.tracer, Replay()), [arg for arg in args if isinstance(arg, torch.Tensor)]
    if pointwise:
        shapeless = tuple(None if isinstance(arg, torch.Tensor) else part for arg, part in zip(args, signature, strict=True))
        return replay.run_pointwise((fn, shapeless), tensors, lambda: fn(*args))
    return replay.run((fn, signature), tensors, lambda: fn(*args))


def active_fake_mode() -> FakeTensorMode | None:
    """The fake-tensor mode in force (None: none)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _fake_run(fake_mode: FakeTensorMode, layouts: dict, signature: object, args: tuple, fn: Callable[[], object]) -> object:
    """``fn()`` in the active fake mode ``fake_mode``, its result's layout recorded under ``signature``; a later call
    with ``signature`` gets fresh (fake) tensors of that layout instead. Recorded only where that is all the result
    is: every leaf None or a tensor outside autograd's graph, at storage offset 0, sharing no argument's storage."""
    if signature in layouts:
        layout, spec = layouts[signature]
        return pytree.tree_unflatten([None if leaf is None else _dense_fake(fake_mode, *leaf) for leaf in layout], spec)
    result = fn()
    leaves, spec = pytree.tree_flatten(result)
    storages = {StorageWeakRef(arg.untyped_storage()) for arg in args if isinstance(arg, torch.Tensor)}
    if all(leaf is None or isinstance(leaf, FakeTensor) and leaf.storage_offset() == 0 and not leaf.requires_grad
           and StorageWeakRef(leaf.untyped_storage()) not in storages for leaf in leaves):
        layouts[signature] = ([None if leaf is None else (leaf.shape, leaf.stride(), leaf.dtype, leaf.device)
                               for leaf in leaves], spec)
    return result


def _symbolic(value) -> bool:
    """A symbolic size (``SymInt``, ``SymFloat``, ``SymBool``), or a tensor with one among its sizes or strides."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt)
                                                   for size in (*value.shape, *value.stride()))


class Unkeyable(Exception):
    """A value ``key`` cannot tell from others by its value (the call is traced, not replayed)."""


_VALUE_TYPES = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def key(value) -> tuple:
    """What a traced result may depend on of one value (a pytree leaf: lists and tuples are flattened by the
    callers, their structure keyed by the tree spec), as a typed, hashable key: a symbolic size by its expression,
    a tensor by its sizes, strides, storage offset, dtype and device, a float by its bits (``-0.0`` is not
    ``0.0``), None, bools, ints, strings, dtypes, devices, layouts and memory formats by their value (typed:
    ``True`` is not ``1``). Anything else raises ``Unkeyable``."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (type(value).__name__, value.node.expr)
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride(), value.storage_offset())
        return ("tensor", tuple(key(size) for size in sizes), value.dtype, value.device)
    if type(value) is float:
        return ("float", value.hex())
    if type(value) in _VALUE_TYPES:
        return (type(value).__name__, value)
    raise Unkeyable(type(value).__name__)



class BlockReplay:
    """Whole blocks of the forward (a run of ONNX nodes, e.g. a transformer layer) traced once per key and replayed,
    forward and backward, for later blocks with that key (the same nodes, attributes and constants, tensors of the
    same layout and ``requires_grad``; other weights).

    Each block is one custom autograd function (``_BlockFunction``). The first block of a key is traced as usual, on
    stand-ins of its input tensors that are the same graph values but start a separate autograd graph, and its
    forward nodes are recorded; its backward is that graph's ``torch.autograd.grad``, traced when the step's backward
    reaches it. When a second block with that key comes, the first block's backward is traced ahead, into a scratch
    graph outside the step: a template, with placeholders for the gradients of its outputs. From then on a block's
    forward copies the recorded forward nodes and its backward copies the template's, under the block's own inputs
    and layer names: the nodes tracing the block would give, without dispatching one op. ``hook`` tags the backward
    nodes with their layer (the tracer's pre-hook of one autograd node). Outside tracing, without grad mode, at
    symbolic sizes or for an input at a storage offset, ``fn`` simply runs."""

    def __init__(self, hook: Callable[[object], None]):
        self._hook = hook
        self._blocks: dict[object, _Block] = {}

    def run(self, key: object, tensors: Sequence[torch.Tensor], layers: Sequence[str],
            fn: Callable[[list[torch.Tensor]], list]) -> list:
        """``fn(tensors)``, the block (a function of ``tensors`` and of values that ``key`` holds), whose nodes are
        named ``layers``: a list of its outputs."""
        mode = get_proxy_mode()
        if (mode is None or not torch.is_grad_enabled()
                or any(_symbolic(t) or t.storage_offset() or not t.is_floating_point() and t.requires_grad
                       for t in tensors)):
            return fn(list(tensors))
        inputs = [_node_of(t, mode.tracer) for t in tensors]
        if None in inputs or len(set(inputs)) < len(inputs):
            return fn(list(tensors))
        full_key = (key, tuple((*_shape_key(t), t.requires_grad) for t in tensors))
        block = self._blocks.get(full_key)
        if block is not None and block.nodes is not None and not block.template(mode.tracer, self._hook):
            block.nodes = None  # cannot be replayed: each block of this key is traced
        call = _BlockCall(block if block is not None and block.nodes is not None else None, mode.tracer, inputs,
                          layers, fn, self._hook)
        outputs = list(_BlockFunction.apply(call, *tensors))
        if block is None:
            self._blocks[full_key] = call.block
        return outputs


class _Block:
    """The first block of a key: its input nodes, layer names, forward nodes (None: not replayable) and outputs,
    the stand-ins of its inputs and its results on them (held until the template is made); the template of its
    backward (``template``)."""

    def __init__(self, inputs, layers, nodes, outputs, stand_ins, results):
        self.inputs: list[torch.fx.Node] = inputs
        self.layers: list[str] = list(layers)
        self.nodes: list[torch.fx.Node] | None = nodes
        self.outputs: list[torch.fx.Node] = outputs
        self.stand_ins: list[torch.Tensor] = stand_ins
        self.results: list = results
        self.differentiable = [isinstance(r, torch.Tensor) and r.requires_grad for r in results]
        self.backward: list[torch.fx.Node] | None = None  # the template: nodes of a scratch graph
        self.grad_outputs: list[torch.fx.Node] = []  # its placeholders: the gradients of the differentiable outputs
        self.grad_inputs: list[torch.fx.Node | None] = []  # its results: the gradient of each input (None: none)

    def template(self, tracer, hook: Callable[[object], None]) -> bool:
        """Make the backward template once (``BlockReplay``); whether the block can be replayed."""
        if self.backward is not None:
            return True
        scratch, graph = torch.fx.Graph(), tracer.graph
        meta = dict(fx_traceback.current_meta)  # the pre-hooks set its tags: restored after
        tracer.graph = scratch
        try:
            grads = []
            for index, result in enumerate(r for r, d in zip(self.results, self.differentiable, strict=True) if d):
                placeholder = scratch.placeholder(f"grad_{index}")
                with disable_proxy_modes_tracing():
                    grad = torch.empty_like(result)
                track_tensor_tree(grad, torch.fx.Proxy(placeholder, tracer), constant=None, tracer=tracer)
                grads.append(grad)
                self.grad_outputs.append(placeholder)
            computed = _local_grads(self.results, self.differentiable, self.stand_ins, grads, retain_graph=True)
        finally:
            tracer.graph = graph
            fx_traceback.current_meta.clear()
            fx_traceback.current_meta.update(meta)
        self.grad_inputs = [None if g is None else _node_of(g, tracer) for g in computed]
        backward = [n for n in scratch.nodes if n.op != "placeholder"]
        known = set(scratch.nodes) | set(self.nodes or ()) | set(self.inputs)
        if (not _closed(backward, known) or any(n.op not in ("call_function", "get_attr") for n in backward)
                or any(g is not None and g not in known for g in self.grad_inputs)):
            return False
        self.backward = backward
        self.stand_ins, self.results = [], []  # the first block's backward is the template's copy too
        return True


def _local_grads(results: list, differentiable: list[bool], stand_ins: list[torch.Tensor], grads: Sequence,
                 retain_graph: bool = False) -> list[torch.Tensor | None]:
    """The gradient of each stand-in (None where it needs none) for ``grads`` of the differentiable results."""
    roots = [r for r, d in zip(results, differentiable, strict=True) if d]
    wanted = [i for i, t in enumerate(stand_ins) if t.requires_grad]
    if not roots or not wanted:
        return [None] * len(stand_ins)
    computed = torch.autograd.grad(roots, [stand_ins[i] for i in wanted], list(grads), retain_graph=retain_graph,
                                   allow_unused=True)
    by_input = dict(zip(wanted, computed, strict=True))
    return [by_input.get(i) for i in range(len(stand_ins))]


def _closed(nodes: list[torch.fx.Node], known: set[torch.fx.Node]) -> bool:
    """Whether ``nodes`` read no node but ``known`` ones."""
    return all(arg in known for n in nodes for arg in n.all_input_nodes)


def _autograd_nodes(roots: Sequence) -> list:
    """The autograd nodes of the graph behind the tensors among ``roots``."""
    seen, stack, found = set(), [r.grad_fn for r in roots if isinstance(r, torch.Tensor)], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        found.append(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


class _BlockCall:
    """One block run by ``_BlockFunction``: its ``_Block`` (None: the first of its key, traced and recorded), the
    tracer, the call's input nodes and layer names, and the copy of each recorded node made for it."""

    def __init__(self, block: _Block | None, tracer, inputs: list[torch.fx.Node], layers: Sequence[str],
                 fn: Callable[[list[torch.Tensor]], list], hook: Callable[[object], None]):
        self.block, self.tracer, self.inputs, self.layers, self.fn, self.hook = block, tracer, inputs, layers, fn, hook
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.rename: dict[str, str] = {}

    def trace(self, tensors: Sequence[torch.Tensor]) -> list:
        """Run ``fn`` on stand-ins of ``tensors`` (the same graph values, a separate autograd graph) and record the
        block (``self.block``); its results."""
        tracer, graph = self.tracer, self.tracer.graph
        stand_ins = []
        for tensor, node in zip(tensors, self.inputs, strict=True):
            meta = dict(node.meta)
            with disable_proxy_modes_tracing():
                stand_in = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)
            stand_in.requires_grad_(tensor.requires_grad)
            track_tensor_tree(stand_in, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)
            node.meta = meta  # the value's own metadata, not the stand-in's
            stand_ins.append(stand_in)
        last = graph._root.prev
        with torch.enable_grad():
            results = self.fn(stand_ins)
        nodes, node = [], last.next
        while node is not graph._root:
            nodes.append(node)
            node = node.next
        outputs = [_node_of(r, tracer) if isinstance(r, torch.Tensor) else None for r in results]
        inside = set(nodes)
        replayable = (all(out in inside for out in outputs) and _closed(nodes, inside | set(self.inputs))
                      and all(n.op in ("call_function", "get_attr") for n in nodes))
        self.block = _Block(self.inputs, self.layers, nodes if replayable else None, outputs, stand_ins, results)
        for fn in _autograd_nodes(results):
            self.hook(fn)
        return results

    def copy(self, nodes: list[torch.fx.Node]) -> None:
        """Copy ``nodes`` into the step's graph, reading ``env``'s copies, with the call's layer names."""
        env = self.env
        for node in nodes:
            copy = env[node] = _copy_node(self.tracer, node, env.__getitem__)
            if node.op == "get_attr":
                continue
            copy.meta = dict(node.meta)
            custom = node.meta.get("custom")
            if custom and custom.get("layer") in self.rename:
                copy.meta["custom"] = {**custom, "layer": self.rename[custom["layer"]]}

    def tensor(self, node: torch.fx.Node) -> torch.Tensor:
        """A fresh tensor tracked as the value of ``env``'s copy of ``node``."""
        with disable_proxy_modes_tracing():
            result = torch.empty_like(node.meta["val"])
        track_tensor_tree(result, torch.fx.Proxy(self.env.get(node, node), self.tracer), constant=None,
                          tracer=self.tracer)
        return result


class _BlockFunction(torch.autograd.Function):
    """A block as one autograd node: traced and recorded (the first of its key) or the recorded forward copied;
    its backward the template copied, or (before there is one) its own autograd graph's."""

    @staticmethod
    def forward(ctx, call: _BlockCall, *tensors: torch.Tensor):
        ctx.call = call
        ctx.set_materialize_grads(False)
        if call.block is None:
            results = call.trace(tensors)
            outputs = [call.tensor(node) if node is not None else result
                       for node, result in zip(call.block.outputs, results, strict=True)]
        else:
            block = call.block
            call.env = dict(zip(block.inputs, call.inputs, strict=True))
            call.rename = dict(zip(block.layers, call.layers, strict=True))
            call.copy(block.nodes)
            outputs = [call.tensor(node) for node in block.outputs]
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, call.block.differentiable, strict=True)
                                      if isinstance(o, torch.Tensor) and not d))
        ctx.outputs = [o for o, d in zip(outputs, call.block.differentiable, strict=True) if d]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        call: _BlockCall = ctx.call
        block = call.block
        given = [g for g, d in zip(grads, block.differentiable, strict=True) if d]
        if all(g is None for g in given):  # no gradient reaches the block's outputs: none leaves its inputs
            return (None,) * (1 + len(block.inputs))
        given = [torch.zeros_like(o) if g is None else g for g, o in zip(given, ctx.outputs, strict=True)]
        if block.backward is None:  # the first block of its key, with no template (yet)
            return (None, *_local_grads(block.results, block.differentiable, block.stand_ins, given))
        if any(_node_of(g, call.tracer) is None for g in given):
            raise LoweringError("a replayed block got a gradient that is not traced (a bridge bug: please report it)")
        if not call.env:  # the first block of its key: its own forward nodes
            call.env = {node: node for node in (*block.inputs, *(block.nodes or ()))}
        call.env.update({p: _node_of(g, call.tracer) for p, g in zip(block.grad_outputs, given, strict=True)})
        call.copy(block.backward)
        return (None, *(None if node is None else call.tensor(node) for node in block.grad_inputs))


class BlockLayouts:
    """``BlockReplay``'s counterpart for a fake-tensor run outside tracing (the conversion's example run,
    ``bridge.api._probe``), which reads only its results' layouts and which weights the model output reaches
    differentiably. The blocks of a key run until two of them show the same facts (``_block_facts``: each
    result's layout and the block inputs it reaches in autograd); a later block of that key gets fresh tensors of
    those layouts, each linked in autograd to the inputs its counterpart reached (``_Reaches``): the output then
    reaches the same weights as running every block would. At symbolic sizes, or inside a trace, ``fn`` runs."""

    def __init__(self):
        self._facts: dict[object, tuple | None] = {}  # key -> the first block's facts (None: not recordable)
        self._confirmed: dict[object, tuple] = {}  # key -> the facts its first two blocks both showed

    def run(self, key: object, tensors: Sequence[torch.Tensor], layers: Sequence[str],
            fn: Callable[[list[torch.Tensor]], list]) -> list:
        """``fn(tensors)``, the block (``BlockReplay.run``), or fresh tensors of its results' layouts."""
        fake_mode = active_fake_mode()
        if fake_mode is None or get_proxy_mode() is not None or any(_symbolic(t) for t in tensors):
            return fn(list(tensors))
        full_key = (key, tuple((*_shape_key(t), t.requires_grad) for t in tensors))
        confirmed = self._confirmed.get(full_key)
        if confirmed is not None:
            return [None if fact is None else _linked(fake_mode, fact, tensors) for fact in confirmed]
        results = fn(list(tensors))
        facts = _block_facts(results, tensors)
        if full_key not in self._facts:
            self._facts[full_key] = facts
        elif facts is not None and facts == self._facts[full_key]:
            self._confirmed[full_key] = facts
        return results


def _block_facts(results: list, tensors: Sequence[torch.Tensor]) -> tuple | None:
    """Per result of a block run on ``tensors``: None, or its layout and the positions of the inputs it reaches in
    autograd (``_reached``; none: it requires no grad). None where a result is anything else (not a fake tensor, at
    a storage offset, sharing an input's storage, or reaching a leaf that is not an input)."""
    storages = {StorageWeakRef(t.untyped_storage()) for t in tensors}
    facts = []
    for result in results:
        if result is None:
            facts.append(None)
            continue
        if (not isinstance(result, FakeTensor) or result.storage_offset()
                or StorageWeakRef(result.untyped_storage()) in storages):
            return None
        reached = _reached(result, tensors) if result.requires_grad else ()
        if reached is None or bool(reached) != result.requires_grad:
            return None
        facts.append((tuple(result.shape), tuple(result.stride()), result.dtype, result.device, reached))
    return tuple(facts)


def _reached(result: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The positions in ``tensors`` of the inputs ``result``'s autograd graph leads to, walking back from it and
    stopping at each input (a computed input by its edge, an input leaf by its gradient accumulator); None where
    the walk meets a leaf that is no input."""
    edges = {(t.grad_fn, t.output_nr): index for index, t in enumerate(tensors) if t.grad_fn is not None}
    leaves = {id(t): index for index, t in enumerate(tensors) if t.requires_grad and t.grad_fn is None}
    reached: set[int] = set()
    seen: set = set()
    stack = [(result.grad_fn, result.output_nr)]
    while stack:
        fn, output = stack.pop()
        if (fn, output) in edges:
            reached.add(edges[(fn, output)])
        elif fn is not None and fn not in seen:
            seen.add(fn)
            if hasattr(fn, "variable"):  # a gradient accumulator: a leaf
                if id(fn.variable) not in leaves:
                    return None
                reached.add(leaves[id(fn.variable)])
            else:
                stack.extend(fn.next_functions)
    return tuple(sorted(reached))


def _linked(fake_mode: FakeTensorMode, fact: tuple, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fresh fake tensor of ``fact``'s layout, reaching in autograd the inputs ``fact`` names (``_Reaches``)."""
    shape, stride, dtype, device, reached = fact
    if not reached:
        return _dense_fake(fake_mode, shape, stride, dtype, device)
    return _Reaches.apply((fake_mode, shape, stride, dtype, device), *(tensors[index] for index in reached))


class _Reaches(torch.autograd.Function):
    """A fresh fake tensor of a given layout whose autograd node leads to the tensors it is given (``_linked``): what a
    walk of the autograd graph sees of a block's result, which no one differentiates."""

    @staticmethod
    def forward(ctx, layout, *inputs):
        return _dense_fake(*layout)

    @staticmethod
    def backward(ctx, *grads):
        raise LoweringError("a stand-in for a repeated block's result in the conversion's example run has no gradient")
