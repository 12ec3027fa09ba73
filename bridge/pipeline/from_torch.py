"""Torch sources: a ``torch.nn.Module`` (an ``onnx2torch`` GraphModule included), a
``torch.export.ExportedProgram`` or a saved ``.pt2``, as the ONNX model the pipeline imports.

The module is exported with the settings that keep everything a training graph needs
(docs/from_pytorch.md): the TorchScript exporter in training mode without constant folding
keeps every parameter under its torch name, BatchNorm as ``BatchNormalization(training_mode=1)``
(so its running statistics are updated) and Dropout as ``Dropout`` (a per-step noise input in the
training graph). The trained set is then exactly the module's ``requires_grad`` parameters.
"""
from __future__ import annotations

import copy
import inspect
import io
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import numpy_helper

from ..contract import BATCH_NORM, PADDING_IDX
from ..errors import BridgeError, InvalidOptionError, ModelLoadError
from .load import check_batch_norm

OPSET = 17
PT2_SUFFIX = ".pt2"
BATCH = "batch"


@dataclass(frozen=True)
class TorchSource:
    """A torch source exported for training: the ONNX model and what the conversion must respect."""

    model: onnx.ModelProto
    parameters: list[str]  # the requires_grad parameters by torch name: the only weights trained
    input_shapes: dict[str, list[int]]  # the example inputs' shapes, by ONNX input name
    dynamic_batch: bool


def is_torch_source(model: Any) -> bool:
    """True for a module, an ExportedProgram or a path to a saved ExportedProgram (``.pt2``)."""
    if isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
        return True
    return isinstance(model, (str, os.PathLike)) and str(model).endswith(PT2_SUFFIX)


def load_torch_source(model: torch.nn.Module | torch.export.ExportedProgram | str | os.PathLike,
                      example_inputs: Iterable[torch.Tensor] | torch.Tensor | None, dynamic_batch: bool | None,
                      batch_norm: str | None = None) -> TorchSource:
    """Export ``model`` for training (``export_for_training``) and list its trained parameters.

    An ExportedProgram brings its own example inputs and (with a ``torch.export.Dim`` on dim 0)
    a dynamic batch; a module needs ``example_inputs``. ``batch_norm``: ``export_for_training``'s."""
    module, example_inputs, exported_dynamic = _as_module(model, example_inputs)
    dynamic = exported_dynamic if dynamic_batch is None else dynamic_batch
    proto = export_for_training(module, example_inputs, dynamic_batch=dynamic, batch_norm=batch_norm)
    graph_inputs = {value.name for value in proto.graph.input}
    shapes = {name: list(arg.shape) for name, arg in zip(_input_names(module, len(example_inputs)), example_inputs, strict=True)
              if name in graph_inputs}
    parameters = [name for name, p in module.named_parameters() if p.requires_grad]
    return TorchSource(proto, parameters, shapes, dynamic)


def module_batch_norm(module: torch.nn.Module) -> str:
    """``frozen`` for a module in ``train()`` whose BatchNorms are all in ``eval()`` (torch normalizes with their
    running statistics and leaves them), else ``train`` (a module in ``eval()`` is trained as ``train()`` would);
    a module in ``train()`` with BatchNorms in both modes is refused: bridge trains every BatchNorm one way."""
    modes = {name: m.training for name, m in module.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    frozen = [name for name, training in modes.items() if not training]
    if not module.training or not frozen:
        return "train"
    if len(frozen) == len(modes):
        return "frozen"
    trained = [name for name, training in modes.items() if training]
    raise InvalidOptionError(
        f"BatchNorm layers {frozen} are in eval() and {trained} in train(): bridge trains every BatchNorm one way; "
        "call .train() or .eval() on all of them, or pass batch_norm='train' or 'frozen'"
    )


def export_for_training(module: torch.nn.Module, example_inputs: Sequence[Any],
                        path: str | os.PathLike | None = None, *, dynamic_batch: bool = False,
                        batch_norm: str | None = None) -> onnx.ModelProto:
    """An ONNX file that trains like ``module``: every parameter under its torch name, BatchNorm
    and Dropout in training form. Equivalent to::

        torch.onnx.export(module, example_inputs, path, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)

    Inputs are named after ``forward``'s arguments, the outputs ``output`` (``output_<i>`` for
    several); ``dynamic_batch`` makes dim 0 of every input and output symbolic. ``batch_norm``
    ``frozen`` marks the file so (``BATCH_NORM``: ``to_training_onnx`` then trains its BatchNorms
    frozen); None: the mode the module's BatchNorms are in (``module_batch_norm``). Raises a
    ``BridgeError`` naming any parameter the export did not keep. Returns the ModelProto (also
    saved to ``path`` when given)."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidOptionError(f"export_for_training needs a torch.nn.Module, got {type(module).__name__}")
    check_batch_norm(batch_norm)
    batch_norm = module_batch_norm(module) if batch_norm is None else batch_norm
    args = _example_tuple(example_inputs)
    input_names = _input_names(module, len(args))
    twin = copy.deepcopy(module)  # a train-mode forward updates running statistics: not the caller's
    with torch.no_grad():
        outputs = twin.train()(*args)
    count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    output_names = ["output"] if count == 1 else [f"output_{i}" for i in range(count)]
    axes = {name: {0: BATCH} for name in input_names + output_names} if dynamic_batch else None
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(twin, args, buffer, dynamo=False, opset_version=OPSET,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=input_names, output_names=output_names, dynamic_axes=axes)
    proto = onnx.load_from_string(buffer.getvalue())
    _restore_state(proto, module)
    _check_parameters_kept(module, args, proto)
    _mark_padding_rows(proto, module)
    if batch_norm == "frozen":
        proto.metadata_props.add(key=BATCH_NORM, value=batch_norm)
    if path is not None:
        onnx.save(proto, str(path))
    return proto


class HFLogits(torch.nn.Module):
    """A Hugging Face model called with positional ``input_ids`` and ``attention_mask``, returning
    only its logits: the one-tensor ``forward`` of positional tensors that the export needs."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def _restore_state(proto: onnx.ModelProto, module: torch.nn.Module) -> None:
    """Initializers named after ``module``'s tensors get their values from before the export (whose
    tracing forwards, in train mode, moved the running statistics)."""
    state = module.state_dict(keep_vars=False)
    for init in proto.graph.initializer:
        if init.name in state:
            init.CopyFrom(numpy_helper.from_array(state[init.name].detach().cpu().numpy(), init.name))


def _as_module(model, example_inputs) -> tuple[torch.nn.Module, tuple, bool]:
    """The module to export, its example inputs and whether dim 0 was exported dynamic."""
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_file():
            raise ModelLoadError(f"{model}: no such file (a saved torch.export.ExportedProgram)")
        model = torch.export.load(str(model))
    if isinstance(model, torch.export.ExportedProgram):
        if example_inputs is None:
            saved = model.example_inputs
            if saved is None or saved[1]:
                raise InvalidOptionError("this ExportedProgram has no positional example inputs; "
                                         "give example_inputs=(...)")
            example_inputs = saved[0]
        return model.module(), _example_tuple(example_inputs), _dynamic_dim0(model)
    if example_inputs is None:
        raise InvalidOptionError("a torch module needs example_inputs=(tensor, ...): the inputs of one "
                                 "forward call, with the batch size to trace with")
    return model, _example_tuple(example_inputs), False


def _example_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(a, torch.Tensor) for a in example_inputs):
        raise InvalidOptionError("example_inputs must be a tensor or a tuple of tensors (one forward call's "
                                 f"positional arguments), got {type(example_inputs).__name__}")
    return tuple(example_inputs)


def _dynamic_dim0(program: torch.export.ExportedProgram) -> bool:
    """True when some user input of ``program`` has a symbolic dim 0 (a ``torch.export.Dim``)."""
    user_inputs = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and node.name in user_inputs and isinstance(value, torch.Tensor) \
                and value.dim() and isinstance(value.shape[0], torch.SymInt):
            return True
    return False


def _input_names(module: torch.nn.Module, count: int) -> list[str]:
    """``forward``'s argument names where it names them all, else ``input_<i>``."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[:count] if len(named) >= count else [f"input_{i}" for i in range(count)]


def _mark_padding_rows(proto: onnx.ModelProto, module: torch.nn.Module) -> None:
    """Tag each Gather that looks up an ``nn.Embedding`` with ``padding_idx`` (its weight as the table, axis 0)
    with that row (``PADDING_IDX``): the ONNX Gather has no padding index, and without it the padding row would
    get a gradient where torch gives it none."""
    rows = {f"{name}.weight": layer.padding_idx for name, layer in module.named_modules()
            if isinstance(layer, torch.nn.Embedding) and layer.padding_idx is not None}
    for node in proto.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type == "Gather" and node.input[0] in rows and axis == 0:
            node.metadata_props.add(key=PADDING_IDX, value=str(rows[node.input[0]]))


def _check_parameters_kept(module: torch.nn.Module, args: tuple, proto: onnx.ModelProto) -> None:
    """Every parameter the output depends on is an initializer under its torch name."""
    kept = {init.name for init in proto.graph.initializer}
    missing = [name for name, p in module.named_parameters() if p.requires_grad and name not in kept]
    if missing:
        missing = _used(module, args, missing)
    if missing:
        raise BridgeError(f"the ONNX export did not keep the parameters {missing} under their torch names "
                          "(renamed or folded by the exporter); they would not be trained")


def _used(module: torch.nn.Module, args: tuple, names: list[str]) -> list[str]:
    """The parameters among ``names`` that the module's outputs depend on (one eager backward on a copy)."""
    twin = copy.deepcopy(module).train()
    params = dict(twin.named_parameters())
    outputs = twin(*args)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    total = sum(o.float().sum() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad)
    if not isinstance(total, torch.Tensor):
        return []
    grads = torch.autograd.grad(total, [params[n] for n in names], allow_unused=True)
    return [name for name, grad in zip(names, grads, strict=True) if grad is not None]
