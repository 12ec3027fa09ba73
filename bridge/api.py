"""``to_training_onnx``: the whole pipeline, stage by stage (see docs/ARCHITECTURE.md)."""
from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch._dynamo  # noqa: F401 - every conversion imports it (make_fx, torch.optim): paid here, at import
import torch._inductor.compiler_bisector  # noqa: F401 - as torch._dynamo: make_fx imports it on first use
import torch._inductor.fx_passes.dedupe_symint_uses  # noqa: F401 - as torch._dynamo
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from . import __version__
from .atomic import check_output_path
from .contract import (
    GROWTH_TRACKER,
    LORA_PLAN,
    LOSS,
    LOSS_OUTPUT,
    LOSS_SCALE,
    LR,
    MEMORY,
    PRECISION,
    STEP,
    TARGET,
    StepSignature,
    slot_name,
)
from .contract import TARGET_CLASSES as CLASSES
from .dtypes import ONNX_TO_TORCH, TORCH_TO_NUMPY
from .errors import BridgeError, InvalidModelError, InvalidOptionError, LoweringError, ShapeError
from .lora import inject_for_training, lora_trainable
from .onnx_file import check_onnx, model_digest, read_model
from .pipeline.annotate import annotate_model
from .pipeline.broadcast import match_scalar_ranks
from .pipeline.cleanup import clean_up
from .pipeline.export import export_step
from .pipeline.export.builder import import_all_emitters
from .pipeline.from_torch import is_torch_source, load_torch_source
from .pipeline.importer.program import OnnxProgram, drop_unimportable_outputs
from .pipeline.importer.registry import buffer_inputs, import_all_converters
from .pipeline.importer.weights import example_run, select_trainable
from .pipeline.load import batch_norm_mode, check_batch_norm, load_pinned, pin_inputs
from .pipeline.losses import INDICES, Loss, make_loss
from .pipeline.low_precision import widen_unsupported
from .pipeline.lowering import decomposition_table
from .pipeline.mixed_precision import make_precision
from .pipeline.optimizers import Optimizer, check_max_norm, make_optimizer
from .pipeline.progress import phase
from .pipeline.remat import check_memory, rematerialize
from .pipeline.source_checks import check_export
from .pipeline.targets import DEFAULT_TARGET, check_target, enabled, using
from .pipeline.trace import StepExample, split_step, static_views_on_meta_kernels, trace_eval_step, trace_training_step
from .training.training_model import TrainingModel

# what every conversion needs once per process, paid here, at import: the converter, lowering and emitter
# modules (registries filled on first use) and torch's core-ATen decomposition table, which torch builds by
# walking every op namespace
import_all_converters()
import_all_emitters()
decomposition_table()


def _cyclic_gc_paused(convert: Callable[..., TrainingModel]) -> Callable[..., TrainingModel]:
    """``convert`` run with Python's cyclic garbage collector paused (as torch's
    ``distributed.checkpoint.state_dict`` does): tracing makes ~10^5 objects that live until it ends (FX nodes,
    fake tensors), enough to set off full collections over everything the process holds (torch's modules, ~10^6
    objects): two, 0.35 s of CPU in a resnet18 conversion. Reference counting frees all else as usual; the few
    cycles left are collected after it (the first young-generation collection then, ~0.07 s for resnet18)."""

    @functools.wraps(convert)
    def paused(*args, **kwargs) -> TrainingModel:
        if not gc.isenabled():
            return convert(*args, **kwargs)
        gc.disable()
        try:
            return convert(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@_cyclic_gc_paused
def to_training_onnx(
    model: str | os.PathLike | onnx.ModelProto | torch.nn.Module | torch.export.ExportedProgram,
    loss: str | Callable = "mse",
    optim: str | type[torch.optim.Optimizer] = "sgd",
    *,
    loss_options: Mapping[str, Any] | None = None,
    optim_options: Mapping[str, Any] | None = None,
    clip_grad_norm: float | None = None,
    output: str | int | None = None,
    extra_outputs: bool | str | int | Iterable[str | int] | None = None,
    trainable: Iterable[str] | str | None = None,
    frozen: Iterable[str] | str | None = None,
    batch_size: int | None = None,
    dynamic_batch: bool | None = None,
    dynamic_dims: bool | Mapping[str, Mapping[int, str] | Iterable[int]] | None = None,
    input_shapes: Mapping[str, Iterable[int]] | None = None,
    output_path: str | os.PathLike | None = None,
    example_inputs: Iterable[torch.Tensor] | torch.Tensor | None = None,
    strict: bool = False,
    target: str = DEFAULT_TARGET,
    constant_inputs: Mapping[str, Any] | None = None,
    lora: Mapping[str, Any] | None = None,
    precision: str = "fp32",
    grad_scaler_options: Mapping[str, Any] | bool | None = None,
    memory: str = "default",
    batch_norm: str | None = None,
) -> TrainingModel:
    """Turn an inference ONNX model into one ONNX graph that performs a whole training step.

    Args:
        model: path to an ``.onnx`` file (external data is loaded) or a ModelProto; or a torch
            source (docs/from_pytorch.md): a ``torch.nn.Module``, a ``torch.export.ExportedProgram``
            or a path to a saved one (``.pt2``), which trains exactly its ``requires_grad``
            parameters under their torch names.
        loss: a loss name (``bridge.pipeline.losses.available_losses()``), a torch loss module or a
            callable ``(output, target) -> scalar``.
        optim: an optimizer name (``bridge.pipeline.optimizers.available_optimizers()``) or a
            ``torch.optim.Optimizer`` subclass.
        loss_options / optim_options: keyword arguments of the torch loss / optimizer
            (``loss_options={"label_format": "probabilities"}``: soft-label targets for ``ce``).
        clip_grad_norm: clip the gradients by global L2 norm to this value before the update,
            as ``torch.nn.utils.clip_grad_norm_`` does.
        output: the model output the loss applies to (name or index; default the first).
        extra_outputs: model outputs (names or indices, or True for all) that the training step
            also returns, as ``output_<name>`` (e.g. the logits, for metrics without a second pass).
            The eval graph (``TrainingModel.eval_model``) always returns every model output.
        trainable / frozen: names or glob patterns of weights to train / not to train.
        batch_size: the batch size to trace with, and of the graph when it is static (default:
            the model's own, or 2 for a symbolic batch).
        dynamic_batch: keep the batch dim symbolic, so one file trains at any batch size.
            Default: symbolic if the model's data inputs have a symbolic first dim.
        dynamic_dims: the symbolic dims, by input name (``{"input_ids": {0: "batch", 1: "seq"}}``,
            or a list of axes to keep the source's dim names), or True: every dim that is symbolic
            in the source model (dim 0 named ``batch``). Replaces ``dynamic_batch``, a
            batch-only shorthand (docs/dynamic_batch.md).
        input_shapes: full shapes for inputs with other symbolic dims, by input name; with
            symbolic dims, the sizes to trace at (a symbolic dim is traced at 2 or more).
        output_path: if given, the training model is also saved there.
        example_inputs: for a torch module, the positional inputs of one forward call (the batch
            size to trace with; an ExportedProgram brings its own).
        strict: raise ``InferenceExportError`` instead of warning when an ONNX model shows signs of
            an inference-optimized export (BatchNorm folded, parameters renamed; docs/from_pytorch.md).
        target: the runtime whose measured forms the graph uses (bridge/pipeline/targets.py): ``onnxruntime``
            (the default), ``iree``, ``onnx-mlir`` or ``plain`` (the canonical graph, no runtime-specific
            form). Every target's graph computes the same step.
        constant_inputs: graph inputs pinned to values (``{"flag": 1}``): each is removed from the graph's
            inputs and becomes a constant, so an ``If`` on it and the shapes computed from it fold at import.
            The eval graph and ``export_inference`` take the same pin (the pinned input is no input there either).
        lora: train LoRA adapters instead of the weights (docs/lora.md): ``{"rank": 8, "alpha": 16, "targets":
            ["*attn*"], "seed": 0}``, targets fnmatch patterns of Gemm/MatMul/Conv weight or node names. The base
            weights stay frozen; ``trainable=`` adds weights trained in full (a new head).
        precision: ``fp32`` (the default), or mixed precision ``fp16`` / ``bf16``: the forward and backward
            compute in that type where torch's autocast would, weights and optimizer state stay float32, and the
            loss is scaled dynamically as ``torch.amp.GradScaler`` does (docs/finetuning.md).
        grad_scaler_options: ``torch.amp.GradScaler``'s ``init_scale``, ``growth_factor``, ``backoff_factor``
            and ``growth_interval`` (its defaults otherwise); ``False``: mixed precision without loss scaling.
        memory: ``default``, or ``min``: the backward recomputes cheap forward values (elementwise ops,
            BatchNorm's output) instead of keeping them alive from the forward; the same results bit for bit,
            a lower peak memory for a little more compute (docs/finetuning.md).
        batch_norm: ``train``: BatchNorm normalizes with the batch's statistics and updates its running ones, as
            torch's ``train()``; ``frozen``: it normalizes with its running statistics, which stay fixed (no
            buffers), as a torch BatchNorm in ``eval()`` inside a model that trains; its scale and bias still train
            unless ``frozen=`` names them (docs/finetuning.md). Default: ``train``; ``frozen`` for a torch module in
            ``train()`` whose BatchNorms are all in ``eval()`` (some in each mode: an error), and for the file
            ``export_for_training`` writes of one.
    """
    target = check_target(target)
    loss_fn = make_loss(loss, dict(loss_options or {}))
    optimizer = make_optimizer(optim, dict(optim_options or {}))
    max_grad_norm = check_max_norm(clip_grad_norm)
    mixed = make_precision(precision, grad_scaler_options)
    memory = check_memory(memory)
    check_batch_norm(batch_norm)
    batch_size = _check_batch_size(batch_size)
    if output_path is not None:
        _check_output_path(model, output_path)
    parameters = None
    if is_torch_source(model):
        torch_source = load_torch_source(model, example_inputs, dynamic_batch, batch_norm)
        model, parameters, dynamic_batch = torch_source.model, torch_source.parameters, torch_source.dynamic_batch
        input_shapes = {**torch_source.input_shapes, **(input_shapes or {})}
    elif example_inputs is not None:
        raise InvalidOptionError("example_inputs= is for torch modules; an ONNX model declares its inputs")
    assert not isinstance(model, (torch.nn.Module, torch.export.ExportedProgram))  # a torch source is ONNX from here
    given = model  # the inference model export_inference writes back to (without adapters)
    plan = None
    if lora is not None:
        model, plan = inject_for_training(model, lora)
        trainable = lora_trainable(plan, trainable)
        parameters = None if parameters is None else [*parameters, *plan.adapter_names]
    with phase("loading the model"):
        source, pins = load_pinned(model, buffer_inputs(), constant_inputs)
        batch_norm = batch_norm_mode(source, batch_norm)
        source_hash = model_digest(source, by_parts=True)  # no serialized copy of the weights just to hash them
        if parameters is None:
            check_export(source, strict=strict)
        declared = [o.name for o in source.graph.output]
        loss_output, extras = declared[_output_index(declared, output)], _extra_outputs(declared, extra_outputs)
        drop_unimportable_outputs(source, [loss_output, *extras])
        output, extra_outputs = loss_output, extras  # names: indices shift where outputs are dropped
    original = _original(given)
    if pins:  # the inference model takes the pin too: the weights were trained on that branch
        original = original if original is not None else read_model(Path(given))
        pin_inputs(original, pins)
    program = OnnxProgram(source, frozen_batch_norm=batch_norm == "frozen")
    source = program.model  # without its weights' data (the program holds them as arrays): one copy in memory
    dims = _dim_spec(source, program, dynamic_batch, dynamic_dims, input_shapes or {})
    inputs = _example_inputs(source, program, batch_size, input_shapes or {}, dims)
    output_index = _output_index(program.output_names, output)

    run = _probe(lambda: _run_example(lambda: example_run(program, inputs, output_index), inputs))
    candidates, buffers, random, example_output = run.differentiable, run.buffers, run.random, run.output
    if parameters is not None:
        candidates = [name for name in candidates if name in parameters]
    candidates = [name for name in candidates if name not in pins]  # a pinned input is a value, not a weight
    scalars = [name for name in candidates if program.initializers[name].ndim == 0]
    weights = select_trainable(candidates, trainable, frozen, scalars, program.floating_initializers())
    if not weights:
        _nothing_to_train(candidates, trainable, frozen)
    state_slots = [(w, slot) for w in weights for slot in optimizer.slots()]
    signature = StepSignature(weights, buffers, state_slots, list(program.input_names), list(random),
                              outputs=_extra_outputs(program.output_names, extra_outputs), loss_scaling=mixed.loss_scaling)

    _check_names_free(source, signature)

    tensors = {name: program.initializer_tensor(name) for name in weights + buffers}
    for w in weights:
        for slot, value in optimizer.initial_state(tensors[w]).items():
            tensors[slot_name(w, slot)] = value
    tensors[STEP] = torch.tensor(0.0)
    tensors[LR] = torch.tensor(optimizer.lr, dtype=torch.float32)
    if mixed.grad_scaler is not None:
        tensors[LOSS_SCALE] = torch.tensor(float(mixed.grad_scaler["init_scale"]), dtype=torch.float32)
        tensors[GROWTH_TRACKER] = torch.tensor(0.0)

    if example_output.numel() == 0:
        raise ShapeError(f"model output '{program.output_names[output_index]}' is empty (shape "
                         f"{list(example_output.shape)}): there is nothing to compute a loss of; choose another output=")
    _check_class_dim(loss_fn, example_output, inputs, program.output_names[output_index])
    spec = loss_fn.target_spec(example_output)
    example_target = torch.zeros(spec.shape, dtype=spec.dtype)
    loss_fn.check(example_output, example_target)

    metadata: dict[str, str] = {}
    example = StepExample(program, loss_fn, tensors, {**inputs, **random}, example_target, output_index, dims, mixed)
    with phase("tracing the training step"), using(target):
        graph_module = trace_training_step(example, optimizer, signature, max_grad_norm=max_grad_norm)
        if memory != "min" and enabled("recompute_from_kept"):  # what costs no memory, without memory="min"
            rematerialize(graph_module, trade=False)
    if memory == "min":
        with phase("recomputing cheap activations in the backward"):
            rematerialize(graph_module)
        metadata[MEMORY] = memory
    eval_signature = signature.for_eval(list(program.output_names))
    gradient_signature, update_signature = signature.split()
    halves = functools.cache(lambda: split_step(graph_module, signature))
    metadata.update({LOSS_OUTPUT: program.output_names[output_index]})
    if plan is not None:
        metadata[LORA_PLAN] = plan.to_json()
    if mixed.dtype is not None:
        metadata[PRECISION] = json.dumps({"precision": mixed.name, "grad_scaler": mixed.grad_scaler})
    classes = _class_targets(loss_fn, example_output)
    if classes is not None:
        metadata[CLASSES] = json.dumps(classes)
    names = {(array.ctypes.data, array.shape): name for name, array in program.initializers.items() if array.size}
    outline = _outline(source)

    def exporter(module: Callable[[], torch.fx.GraphModule], sig: StepSignature) -> Callable[..., onnx.ModelProto]:
        def export(stubs=None) -> onnx.ModelProto:
            with using(target):
                return _export(module(), sig, outline, source_hash, loss_fn, optimizer, metadata, names, stubs,
                               mixed.dtype is not None)

        return export

    def eval_module() -> torch.fx.GraphModule:
        with phase("tracing the eval step"), using(target):
            return trace_eval_step(example, eval_signature)

    training = exporter(lambda: graph_module, signature)()
    # the eval, gradient and update graphs are exported on request (TrainingModel.part; for save(), with the
    # frozen weights as the traced graphs' arrays, shared with the importer's, not as protobuf copies); the eval
    # step is also traced then, the gradient and update graphs cut from the training step's (split_step)
    parts = {"eval": exporter(eval_module, eval_signature),
             "gradient": exporter(lambda: halves()[0], gradient_signature),
             "update": exporter(lambda: halves()[1], update_signature)}

    # the weights and buffers share memory with the program's initializers (initial_state() copies)
    initial = {name: tensors[name].detach().numpy() for name in signature.state_names()}
    result = TrainingModel(training, signature, initial, tuple(spec.shape), np.dtype(TORCH_TO_NUMPY[spec.dtype]),
                           eval_signature=eval_signature, source=original,
                           source_path=None if isinstance(given, onnx.ModelProto) or pins else Path(given).resolve(),
                           exporters=parts, lora=plan)
    if output_path is not None:
        result.save(output_path)
    return result


def _export(graph_module, signature: StepSignature, source: onnx.ModelProto, source_hash: str,
            loss: Loss, optimizer: Optimizer, metadata: dict[str, str],
            constant_names: Mapping[tuple[int, tuple[int, ...]], str], stubs: dict | None = None,
            low_precision: bool = False) -> onnx.ModelProto:
    """Export, annotate and check one traced graph (the training step or the eval step) under the current
    target (``targets.using``); ``stubs``: see ``GraphBuilder.write_initializers``; ``low_precision``: a
    mixed-precision graph, whose nodes without a float16/bfloat16 form compute in float32 (``widen_unsupported``)."""
    with phase(f"exporting {len(graph_module.graph.nodes)} traced nodes to ONNX"):
        model = export_step(graph_module, signature, constant_names, stubs)
        clean_up(model)
        if low_precision:
            widen_unsupported(model)
        if enabled("scalar_ranks"):
            match_scalar_ranks(model)
    annotate_model(model, signature, source=source, source_hash=source_hash, loss=loss, optimizer=optimizer,
                   version=__version__)
    for key, value in metadata.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    with phase("checking the exported ONNX graph"):
        check_onnx(model, "an exported step graph (a bridge bug: please report it)", LoweringError,
                   full_check=True)
    return model


def _outline(source: onnx.ModelProto) -> onnx.ModelProto:
    """What ``annotate_model`` reads of the source (its graph's name, nodes and outputs), without its
    initializers: held by the on-request exporters instead of the whole source."""
    outline = onnx.ModelProto()
    outline.graph.name = source.graph.name
    outline.graph.node.extend(source.graph.node)
    outline.graph.output.extend(source.graph.output)
    return outline


def _class_targets(loss: Loss, output: torch.Tensor) -> dict | None:
    """For a loss on class indices: the class count of ``output`` and the ignored index
    (what ``bridge.training.feed_checks.StepChecks`` checks targets against)."""
    if loss.name not in ("ce", "nll") or loss.label_format != INDICES or output.dim() == 0:
        return None
    axis = 2 if output.dim() == 3 else min(1, output.dim() - 1)  # [N, T, V] sequences, [N, C, ...], [C]
    return {"classes": int(output.shape[axis]), "ignore_index": int(loss.options.get("ignore_index", -100)),
            "axis": axis}


def _original(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto | None:
    """The inference model as given (before load's clean-up), kept for ``export_inference``; a model
    given by path is read again when needed (``TrainingModel.source_path``), not held twice."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    return None


def _check_batch_size(batch_size: int | None) -> int | None:
    """``batch_size=`` validated: None or an int >= 1 (a bool is not a size)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InvalidOptionError(f"batch_size={batch_size!r} is not valid; give an integer >= 1 (or None)")
    return int(batch_size)


def _check_output_path(model: object, output_path: str | os.PathLike) -> None:
    """``output_path=`` must be a writable file path, and not the source model itself."""
    check_output_path(output_path, "output_path")
    if isinstance(model, (str, os.PathLike)) and os.path.abspath(output_path) == os.path.abspath(model):
        raise InvalidOptionError(f"output_path '{output_path}' is the input model: writing there would replace "
                                 "the source; give another file name")


def _run_example(run: Callable, inputs: Mapping[str, torch.Tensor]):
    """``run()`` (the first eager run of the model); a shape mismatch inside the model is a ``ShapeError``
    naming the example input shapes (from the model, ``batch_size=`` and ``input_shapes=``)."""
    shapes = ", ".join(f"'{name}': {list(value.shape)}" for name, value in inputs.items())
    try:
        return run()
    except ShapeError as exc:
        if not isinstance(exc.__cause__, RuntimeError):  # not a node failing on these shapes
            raise
        raise ShapeError(f"{exc}; the example inputs had shapes {{{shapes}}}: check batch_size= and input_shapes= "
                         "against the model (a static model may hard-code its batch size)") from exc
    except (RuntimeError, ValueError, IndexError) as exc:
        if isinstance(exc, BridgeError):
            raise
        raise ShapeError(f"the model fails on inputs of shapes {{{shapes}}}: {exc}; check batch_size= and "
                         "input_shapes= against the model (a static model may hard-code its batch size)") from exc


def _probe(run: Callable[[], Any]) -> Any:
    """``run()``, an example run of the model that only shapes, dtypes and the autograd graph are read of, on
    fake tensors (no arithmetic: its cost does not grow with the data's size). Tensors it returns come back as
    real zeros of their shape and dtype. A model that needs values to run (a converter that reads data, such as
    NonMaxSuppression's) fails on fakes: it runs again on real tensors, which raises the error to report."""
    with phase("running the model on example inputs"):
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), static_views_on_meta_kernels():
                result = run()
        except Exception:  # noqa: BLE001 - run again for real: the real run raises the error (or succeeds)
            return run()
        return _real_zeros(result)


def _real_zeros(value: Any) -> Any:
    """``value`` (dict values and dataclass fields walked) with every fake tensor as real zeros of its shape
    and dtype."""
    if isinstance(value, FakeTensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, dict):
        return {k: _real_zeros(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _real_zeros(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def _nothing_to_train(candidates: list[str], trainable, frozen) -> None:
    """Raise the error for a conversion that leaves no weight to train."""
    if not candidates:
        raise InvalidModelError("the model has no trainable weight: no floating-point initializer reaches the "
                                "chosen output differentiably (nothing to train)")
    raise InvalidOptionError(f"trainable={trainable!r} / frozen={frozen!r} leave no weight to train; the "
                             f"candidates are {candidates}: freeze fewer of them")


def _check_class_dim(loss: Loss, output: torch.Tensor, inputs: Mapping[str, torch.Tensor], name: str) -> None:
    """Class-index ``ce``/``nll`` on a 1-d output whose length is the batch would take the batch as the
    classes (torch's unbatched form): refused."""
    if loss.name not in ("ce", "nll") or loss.label_format != INDICES or output.dim() != 1:
        return
    batches = {value.shape[0] for value in inputs.values() if value.dim() >= 1}
    if output.shape[0] in batches:
        raise InvalidOptionError(
            f"loss '{loss.name}' on model output '{name}' of shape {list(output.shape)}: a 1-d output of the "
            "batch's length has no class dim (torch would read the batch as the classes); give the model an "
            "[N, C] output, or use loss 'bce_with_logits' for one score per sample"
        )


def _extra_outputs(output_names: Sequence[str], extra: bool | str | int | Iterable[str | int] | None) -> list[str]:
    """Names of the model outputs that ``extra_outputs=`` selects."""
    if extra is None or extra is False:
        return []
    if extra is True:
        return list(output_names)
    if isinstance(extra, (str, int)):
        extra = [extra]
    names = [output_names[_output_index(output_names, item, "extra_outputs")] for item in extra]
    return list(dict.fromkeys(names))


def _check_names_free(source: onnx.ModelProto, signature: StepSignature) -> None:
    """The names the training graph adds (``target``, ``step``, ``lr``, ``loss``, optimizer state,
    ``grad_*``, ``updated_*``) must not already name a value of the source model."""
    graph = source.graph
    used = {v.name for v in list(graph.input) + list(graph.initializer)} | {o for n in graph.node for o in n.output}
    kept = set(signature.weights) | set(signature.buffers) | set(signature.inputs) | set(signature.random)
    added = (set(signature.input_names()) | set(signature.output_names())) - kept | {TARGET, STEP, LR, LOSS}
    clashes = sorted(used & added)
    if clashes:
        raise BridgeError(f"the model already has values named {clashes}, names that the training graph gives "
                          "its own inputs and outputs (docs/ir.md); rename them in the source model")


BATCH = "batch"  # the dim_param of a symbolic batch
TRACE_SIZE = 7  # the size a symbolic non-batch dim is traced at when neither the model nor input_shapes gives one
_MIN_TRACE_SIZE = 2  # tracing specialises sizes 0 and 1, so a symbolic dim is traced at 2 or more


def _dim_spec(model: onnx.ModelProto, program: OnnxProgram, dynamic_batch: bool | None,
              dynamic_dims: bool | Mapping[str, Mapping[int, str] | Iterable[int]] | None,
              shapes: Mapping[str, Iterable[int]]) -> dict[str, dict[int, str]]:
    """The symbolic dims of the data inputs: input name -> {axis: dim name}."""
    values = {v.name: v for v in model.graph.input if v.name in program.input_names}
    ranks = {name: len(list(shapes[name])) if name in shapes else len(v.type.tensor_type.shape.dim)
             for name, v in values.items()}
    if dynamic_dims is not None and dynamic_batch is not None:
        raise InvalidOptionError("give dynamic_dims= or dynamic_batch=, not both (dynamic_dims names the batch dim "
                                 f"too, e.g. {{'input': {{0: '{BATCH}'}}}})")
    if dynamic_dims is None:
        if not (_has_symbolic_batch(model, program) if dynamic_batch is None else dynamic_batch):
            return {}
        return {name: {0: BATCH} for name, rank in ranks.items() if rank}
    if dynamic_dims is False:
        return {}
    if dynamic_dims is True:
        return {name: axes for name, v in values.items()
                if (axes := {axis: _source_dim_name(v, axis) for axis, d in enumerate(v.type.tensor_type.shape.dim)
                             if not d.HasField("dim_value")})}
    unknown = sorted(set(dynamic_dims) - set(values))
    if unknown:
        raise InvalidOptionError(f"dynamic_dims names unknown inputs {unknown}; inputs: {list(values)}")
    spec = {}
    for name, given in dynamic_dims.items():
        named = dict(given) if isinstance(given, Mapping) else {axis: _source_dim_name(values[name], axis) for axis in given}
        bad = [axis for axis in named if not isinstance(axis, int) or not -ranks[name] <= axis < ranks[name]]
        if bad:
            raise InvalidOptionError(f"dynamic_dims['{name}'] names axes {bad}, but input '{name}' has rank {ranks[name]}")
        spec[name] = {axis % ranks[name]: str(dim) for axis, dim in named.items()}
    return spec


def _source_dim_name(value: onnx.ValueInfoProto, axis: int) -> str:
    """The name of a symbolic dim: ``batch`` for dim 0, else the source's dim_param (or ``<input>_<axis>``)."""
    dim = value.type.tensor_type.shape.dim[axis]
    if axis == 0:
        return BATCH
    return dim.dim_param or f"{value.name}_{axis}"


def _example_inputs(
    model: onnx.ModelProto, program: OnnxProgram, batch_size: int | None, shapes: Mapping[str, Iterable[int]],
    dims: Mapping[str, Mapping[int, str]],
) -> dict[str, torch.Tensor]:
    """Tensors with the shapes and dtypes of the graph's data inputs (symbolic dims resolved;
    the symbolic dims of ``dims`` at a size of 2 or more, see ``TRACE_SIZE``)."""
    unknown = sorted(set(shapes) - set(program.input_names))
    if unknown:
        raise InvalidOptionError(f"input_shapes names unknown inputs {unknown}; inputs: {program.input_names}")
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for value in model.graph.input:
        if value.name not in program.input_names:
            continue
        tensor_type = value.type.tensor_type
        symbolic = dims.get(value.name, {})
        if value.name in shapes:
            sizes = _given_shape(value, shapes[value.name])
        else:
            sizes = []
            for axis, dim in enumerate(tensor_type.shape.dim):
                if dim.HasField("dim_value"):
                    sizes.append(dim.dim_value)
                elif axis == 0:
                    sizes.append(batch_size or 2)
                elif axis in symbolic:
                    sizes.append(TRACE_SIZE)
                else:
                    raise InvalidOptionError(
                        f"input '{value.name}' has symbolic dim {axis} ('{dim.dim_param}'); "
                        f"give its shape with input_shapes={{'{value.name}': [...]}} or keep it symbolic "
                        f"with dynamic_dims={{'{value.name}': {{{axis}: '{dim.dim_param or 'name'}'}}}}"
                    )
            if batch_size and sizes:
                sizes[0] = batch_size
        sizes = [max(size, _MIN_TRACE_SIZE) if axis in symbolic else size for axis, size in enumerate(sizes)]
        dtype = ONNX_TO_TORCH.get(tensor_type.elem_type)
        if dtype is None:
            raise BridgeError(f"input '{value.name}' has an unsupported element type {tensor_type.elem_type}")
        if dtype.is_floating_point:
            inputs[value.name] = torch.randn(sizes, generator=generator).to(dtype)
        else:
            inputs[value.name] = torch.zeros(sizes, dtype=dtype)
    return inputs


def _given_shape(value: onnx.ValueInfoProto, given: Iterable[int]) -> list[int]:
    """An ``input_shapes=`` entry checked against the input's declared rank and fixed dims."""
    dims = list(given)
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise InvalidOptionError(f"input_shapes['{value.name}'] = {dims}: every dim must be an integer >= 1")
    declared = value.type.tensor_type.shape.dim
    if value.type.tensor_type.HasField("shape") and len(declared) != len(dims):
        raise ShapeError(f"input_shapes['{value.name}'] = {dims} has {len(dims)} dims; input '{value.name}' "
                         f"has {len(declared)}")
    for axis, (dim, size) in enumerate(zip(declared, dims, strict=False)):
        if axis > 0 and dim.HasField("dim_value") and dim.dim_value != size:
            raise ShapeError(f"input_shapes['{value.name}'] = {dims}: dim {axis} is fixed to {dim.dim_value} "
                             f"in the model, not {size}")
    return [int(d) for d in dims]


def _has_symbolic_batch(model: onnx.ModelProto, program: OnnxProgram) -> bool:
    """True when some data input has a symbolic (or unknown) first dim."""
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in program.input_names and dims and not dims[0].HasField("dim_value"):
            return True
    return False


def _output_index(output_names: Sequence[str], output: str | int | None, option: str = "output") -> int:
    if output is None:
        return 0
    if isinstance(output, bool):
        raise InvalidOptionError(f"{option}={output} is a bool, not an output name or index; "
                                 f"outputs: {list(output_names)}")
    if isinstance(output, int):
        if not 0 <= output < len(output_names):
            raise InvalidOptionError(f"{option}={output} is out of range; the model has {len(output_names)} outputs")
        return output
    if output not in output_names:
        raise InvalidOptionError(f"{option}='{output}' is not a model output; outputs: {list(output_names)}")
    return list(output_names).index(output)
