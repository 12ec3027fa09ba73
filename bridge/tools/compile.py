"""Compile a training ONNX model with an MLIR compiler (IREE or onnx-mlir) for the host CPU.

IREE: ONNX -> MLIR (torch-mlir's ONNX importer, what ``iree-import-onnx`` runs) -> ``iree-compile``
(llvm-cpu) -> a ``.vmfb`` module. Each imported op carries its ONNX node's name as its MLIR
location, so a compiler error is reported with the offending node; the entry function carries
the graph's input and output names (IREE reflection), so a ``.vmfb`` is self-describing and
``bridge.training.runtime_iree.IreeTrainingSession`` runs it like the onnxruntime session.

onnx-mlir: ``onnx-mlir --EmitLib -O3`` (its phases: ONNX -> MLIR, ONNX-level passes, LLVM, object,
link) -> a model ``.so``, which ``bridge.training.runtime_onnx_mlir.OnnxMlirTrainingSession`` runs.
onnx-mlir's ops carry the ONNX node's name (``onnx_node_name``, ``loc("name")``), so its errors
are reported with the node too. onnx-mlir's compile time grows with about the square of a graph's
node count (one LLVM function holds every op), so a large graph is compiled in pieces
(``bridge.tools.pieces``), in parallel, and run in sequence.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ..contract import (
    IN_PLACE,
    INPUT_SPECS,
    INPUTS,
    LAYER,
    OUTPUTS,
    PHASE,
    PIECE,
    RANDOM_INPUTS,
    Phase,
    encode_random_inputs,
    props,
    updated_name,
)
from ..errors import BridgeError, InvalidOptionError
from ..onnx_file import external_copy, is_large, model_digest, read_model
from ..training.runtime import StepSession, is_gradient, outputs_dropped
from ..training.runtime_iree import IreeTrainingSession, require_iree
from ..training.runtime_onnx_mlir import (
    INSTALL_HINT,
    OnnxMlirNotFoundError,
    OnnxMlirTrainingSession,
    find_onnx_mlir,
    pack_pieces,
)
from .pieces import STATE_SHARE_PER_PIECE, UntypedCutError, auto_count, split

if TYPE_CHECKING:
    from ..training.training_model import TrainingModel

BACKENDS = ("iree", "onnx-mlir")
_MAX_ERRORS = 5
# IREE demotes float64 to float32 by default; bridge's optimizer rules compute bias corrections
# in float64 (Adam's 1 - beta2**step loses ~1e-5 relative in float32), so keep float64.
_IREE_FLAGS = ("--iree-input-demote-f64-to-f32=false",)
_HOST_CPU = {"iree": "host", "onnx-mlir": "native"}  # how each compiler names the CPU it runs on
_ONNX_MLIR_FLAGS = ("--EmitLib", "-O3")  # onnx-mlir's defaults for a library, at its optimization level 3
# pieces="auto": graphs are cut into pieces of about this many nodes (smaller graphs stay whole)
NODES_PER_PIECE = 300
# Opt-in (``extra_args=FAST_CONV_FLAGS``): IREE 3.13 compiles a Conv as a direct convolution, which
# took 2-6x onnxruntime's CPU time per Conv at resnet18's sizes; im2col + a data-tiled matmul is on
# par with onnxruntime (docs/notes/onnx-mlir-iree-investigations.md section 8). Not the default until the whole zoo is checked.
FAST_CONV_FLAGS = ("--iree-global-opt-use-im2col-for-convs", "--iree-opt-data-tiling")


class CompileError(BridgeError):
    """The MLIR compiler rejected the model; the message names the offending ONNX nodes.

    ``diagnostics`` holds each error as ``(node name, op type, message)`` (empty names when the
    compiler located the error nowhere in the graph)."""

    def __init__(self, message: str, diagnostics: list[tuple[str, str, str]] | None = None):
        super().__init__(message)
        self.diagnostics = diagnostics or []


Progress = Callable[[str], None]


@dataclass
class CompiledModel:
    """A compiled training step: ``module``, the bytes of an IREE ``.vmfb`` or an onnx-mlir ``.so``; ``graph``,
    the training graph it was compiled from (its noise inputs, batch checks and checkpoint identity); when
    compiled from a TrainingModel, its initial state."""

    module: bytes = field(repr=False)
    backend: str = "iree"
    seconds: float = 0.0
    initial_state: dict[str, np.ndarray] | None = field(default=None, repr=False)
    graph: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def vmfb(self) -> bytes:
        """The IREE module (``module``)."""
        return self.module

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``module`` to ``path`` (``.vmfb`` for IREE, ``.so`` for onnx-mlir, a zip of the pieces' ``.so``
        when compiled in pieces); ``OnnxMlirTrainingSession(path, ...)`` loads either."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.module)
        return path

    def session(self, state: dict[str, np.ndarray] | None = None, driver: str = "local-task",
                seed: int | None = None, *, eval_model: onnx.ModelProto | None = None,
                on_nonfinite: str = "raise") -> StepSession:
        """A session of this backend holding ``state`` (default: the TrainingModel's initial state);
        ``driver``: IREE's (onnx-mlir runs on one thread); ``eval_model`` enables ``evaluate`` (onnx-mlir:
        compiled too; IREE: run in onnxruntime)."""
        if state is None:
            if self.initial_state is None:
                raise InvalidOptionError("this module was not compiled from a TrainingModel: pass state=")
            state = {name: value.copy() for name, value in self.initial_state.items()}
        if self.backend == "onnx-mlir":
            eval_library = None if eval_model is None else compile(eval_model, backend="onnx-mlir").module
            return OnnxMlirTrainingSession(self.module, state, seed, training_model=self.graph, eval_model=eval_model,
                                           eval_library=eval_library, on_nonfinite=on_nonfinite)
        return IreeTrainingSession(self.module, state, driver=driver, seed=seed, training_model=self.graph,
                                   eval_model=eval_model, on_nonfinite=on_nonfinite)


def to_mlir(model: TrainingModel | onnx.ModelProto | str | os.PathLike, in_place: Sequence[str] = ()) -> str:
    """The model as MLIR in torch-mlir's ONNX form (``iree-import-onnx``), node names as locations.

    ``in_place``: state inputs (``in_place_state``) that the function overwrites with their ``updated_*``
    value (torch's mutable-tensor form: IREE writes the new value into the argument's buffer) instead of
    returning it; the reflection lists them under ``IN_PLACE`` and leaves their outputs out of ``OUTPUTS``."""
    require_iree()
    from iree.compiler import ir

    proto = _shapes_inferred(read_model(model))
    context = ir.Context()
    module = _define_function(ir, _new_module(context, proto), proto, proto, list(in_place))
    module.verify()
    return module.get_asm(enable_debug_info=True)


def step_in_two_calls(model: onnx.ModelProto) -> str:
    """The step as MLIR with two functions that a session calls in turn, every state updated in place: the
    forward and backward (loss, gradients, and the state they update, such as batch-norm statistics), then
    the optimizer. Between the calls every read of the old weights has run, so the optimizer overwrites
    each state it updates (``in_place_state`` of its piece); a graph without optimizer nodes is one function
    (``to_mlir`` with ``in_place_state``). Each function's reflection carries ``PIECE``: its place in the
    run order and the graph's inputs and outputs."""
    require_iree()
    from iree.compiler import ir

    proto = _shapes_inferred(model)
    nodes = [node for node in proto.graph.node if not (node.op_type == "Constant" and not node.input)]
    first_update = next((index for index, node in enumerate(nodes)
                         if props(node.metadata_props).get(PHASE) == Phase.OPTIMIZER), 0)
    if first_update == 0:
        return to_mlir(proto, in_place_state(proto))
    pieces = split(proto, cuts=[first_update])
    context = ir.Context()
    module = _new_module(context, proto)
    # a state a later piece reads stays whole until that piece has run
    in_place = [[name for name in in_place_state(piece.model)
                 if not any(name in later.inputs for later in pieces[index + 1:])] for index, piece in enumerate(pieces)]
    overwritten = {updated_name(name) for names in in_place for name in names}
    step = {"inputs": [v.name for v in proto.graph.input],
            "outputs": [v.name for v in proto.graph.output if v.name not in overwritten]}
    for index, piece in enumerate(pieces):
        _define_function(ir, module, _shapes_inferred(piece.model), proto, in_place[index], {"index": index, **step})
    module.verify()
    return module.get_asm(enable_debug_info=True)


def _shapes_inferred(proto: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError) as exc:
        raise CompileError(f"ONNX shape inference failed before import: {exc}") from exc


def _new_module(context, proto: onnx.ModelProto):
    """An empty MLIR module for the functions imported from ``proto`` (or its pieces)."""
    from iree.compiler.extras import onnx_importer

    return onnx_importer.ModelInfo(proto).create_module(context=context).operation


def _define_function(ir, module, proto: onnx.ModelProto, graph: onnx.ModelProto, in_place: list[str],
                     piece: dict | None = None):
    """Import ``proto`` into ``module`` as a function (named after its graph), with its reflection:
    input and output names, ``in_place`` (``to_mlir``), and ``graph``'s input specs and random inputs
    (``graph``: the whole step, of which ``proto`` may be a piece: ``PIECE``)."""
    from iree.compiler.extras import onnx_importer

    info = onnx_importer.ModelInfo(proto)
    try:
        onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
    except onnx_importer.OnnxImportError as exc:
        raise CompileError(f"the ONNX importer (torch-mlir) rejected graph '{proto.graph.name}': {exc}") from exc
    block = module.regions[0].blocks[0]
    function = block.operations[len(block.operations) - 1]
    outputs = [v.name for v in proto.graph.output]
    with module.context:
        if in_place:
            _overwrite_arguments(ir, function, [v.name for v in proto.graph.input], outputs, in_place)
            outputs = [name for name in outputs if name not in {updated_name(state) for state in in_place}]
        function.attributes["iree.reflection"] = ir.DictAttr.get({
            **({IN_PLACE: ir.StringAttr.get(json.dumps(in_place))} if in_place else {}),
            **({PIECE: ir.StringAttr.get(json.dumps(piece))} if piece is not None else {}),
            INPUTS: ir.StringAttr.get(json.dumps([v.name for v in proto.graph.input])),
            OUTPUTS: ir.StringAttr.get(json.dumps(outputs)),
            INPUT_SPECS: ir.StringAttr.get(json.dumps(_input_specs(graph))),
            # the same payload as the model metadata's
            RANDOM_INPUTS: ir.StringAttr.get(props(graph.metadata_props).get(RANDOM_INPUTS, encode_random_inputs([]))),
        })
    return module


def in_place_state(model: onnx.ModelProto) -> list[str]:
    """The state inputs whose ``updated_*`` output a step can write into the input's own buffer: those whose
    every reader is computed before the update (an ancestor of the node that computes ``updated_<x>``, or
    that node), so that no read of the old value can follow the write. A weight that the backward still
    reads after its own update is computable (``dX = dY @ W`` is no ancestor of ``W``'s update) is left out:
    IREE orders dispatches by data only, and would let the update overwrite ``W`` before that read."""
    graph = model.graph
    producer = {output: index for index, node in enumerate(graph.node) for output in node.output}
    readers: dict[str, set[int]] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, set()).add(index)
    output_names = [v.name for v in graph.output]
    types = {v.name: v.type for v in [*graph.input, *graph.output]}
    chosen = []
    for value in graph.input:
        updated = updated_name(value.name)
        if (updated not in producer or updated not in output_names or value.name in output_names
                or types[updated] != types[value.name]):
            continue
        if readers.get(value.name, set()) <= _ancestors(producer[updated], graph.node, producer):
            chosen.append(value.name)
    return chosen


def _ancestors(index: int, nodes, producer: dict[str, int]) -> set[int]:
    """The indices of node ``index`` of ``nodes`` and of every node it depends on (``producer``: value -> node)."""
    seen, stack = set(), [index]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(producer[name] for name in nodes[current].input if name in producer)
    return seen


def _overwrite_arguments(ir, function, inputs: list[str], outputs: list[str], in_place: Sequence[str]) -> None:
    """Rewrite the imported ``function`` so that each state in ``in_place`` is a mutable tensor argument
    (``!torch.tensor``): read once as a value (``torch.copy.to_vtensor``), overwritten with its
    ``updated_*`` result (``torch.overwrite.tensor.contents``), and that result no longer returned."""
    block = function.regions[0].blocks[0]
    returned = block.operations[len(block.operations) - 1]
    results = list(returned.operands)
    first = block.operations[0]
    for state in in_place:
        argument = block.arguments[inputs.index(state)]
        value_type = argument.type
        argument.set_type(ir.Type.parse(str(value_type).replace("!torch.vtensor", "!torch.tensor", 1)))
        with ir.InsertionPoint(first), function.location:
            value = ir.Operation.create("torch.copy.to_vtensor", results=[value_type], operands=[argument])
        argument.replace_all_uses_except(value.result, value)
        with ir.InsertionPoint(returned), returned.location:
            ir.Operation.create("torch.overwrite.tensor.contents",
                                operands=[results[outputs.index(updated_name(state))], argument])
    dropped = {outputs.index(updated_name(state)) for state in in_place}
    kept = [result for index, result in enumerate(results) if index not in dropped]
    with ir.InsertionPoint(returned), returned.location:
        ir.Operation.create("func.return", operands=kept)
    returned.erase()
    function.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([argument.type for argument in block.arguments], [result.type for result in kept]))


def compile(  # noqa: A001 - bridge.compile is the public name
    model: TrainingModel | onnx.ModelProto | str | os.PathLike,
    backend: str = "iree",
    output: str | os.PathLike | None = None,
    *,
    target_cpu: str | None = None,
    extra_args: tuple[str, ...] = (),
    progress: Progress | None = None,
    gradients: bool = True,
    timeout: float | None = None,
    pieces: int | str = "auto",
    in_place: bool = False,
) -> CompiledModel:
    """Compile a training ONNX model for the CPU; returns the module (also written to ``output``).

    Args:
        model: a TrainingModel, a training ModelProto, or the path of a training ``.onnx``.
        backend: ``"iree"`` (llvm-cpu target) or ``"onnx-mlir"`` (``--EmitLib -O3``; found by ``find_onnx_mlir``).
        output: where to write the ``.vmfb`` (IREE) or ``.so`` (onnx-mlir) (optional).
        target_cpu: IREE: ``--iree-llvmcpu-target-cpu`` (default ``host``; ``generic`` for a portable module);
            onnx-mlir: ``--mcpu`` (default: onnx-mlir's own). ``"host"`` and ``"native"`` both mean this machine's
            CPU, for either backend (IREE spells it ``host``, onnx-mlir ``native``; each aborts on the other's).
        extra_args: further compiler flags (e.g. IREE's ``FAST_CONV_FLAGS``).
        progress: called with a line as each phase starts and ends, with the elapsed time (IREE:
            ``import``, ONNX -> MLIR, and ``compile``, iree-compile; onnx-mlir: each phase it reports,
            ``onnx-mlir [1/6] Importing ONNX Model to MLIR Module`` to ``[5/6] Linking``); ``bridge compile`` prints them.
        gradients: ``False``: the module does not return the ``grad_*`` outputs (a ``bridge.Trainer``
            never reads them), so the compiler need not write them out; the step computes the same.
        timeout: onnx-mlir: seconds after which the compile is stopped (a ``CompileError``); None: no limit.
            Large graphs take minutes to compile.
        pieces: onnx-mlir: how many pieces of contiguous nodes the graph is compiled in (compiled in parallel
            on the machine's cores, run in sequence; ``module`` is then a zip of their libraries);
            ``"auto"``: pieces of about ``NODES_PER_PIECE`` nodes, one for a smaller graph. IREE: 1 or ``"auto"``.
        in_place: the step's new state takes the memory of the old. IREE: the step writes every updated state
            into the state's own buffer; the module holds two functions the session calls in turn, the forward
            and backward, then the optimizer (``step_in_two_calls``). onnx-mlir: the session releases each state
            array once the last piece that reads it has run, and the optimizer phase is cut further so that no
            piece replaces more than ``STATE_SHARE_PER_PIECE`` of the state (a small graph too), and so that such a
            large array is released before its update is made (``state_bounded_cuts``). The session's
            state then holds the step's values even when the step is not finite: ``on_nonfinite="skip"`` is refused,
            ``"raise"`` says so.
    """
    if backend not in BACKENDS:
        raise InvalidOptionError(f"backend='{backend}' is not supported; backends: {list(BACKENDS)}")
    if not isinstance(gradients, bool):
        raise InvalidOptionError(f"gradients={gradients!r} is not valid; give True or False")
    if not isinstance(in_place, bool):
        raise InvalidOptionError(f"in_place={in_place!r} is not valid; give True or False")
    if timeout is not None and backend != "onnx-mlir":
        raise InvalidOptionError(f"timeout= is for backend='onnx-mlir' only, not '{backend}' (IREE compiles in this process)")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e9):
        raise InvalidOptionError(f"timeout={timeout!r} is not valid; give a number of seconds > 0, or None for no limit")
    if pieces != "auto" and (isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1):
        raise InvalidOptionError(f"pieces={pieces!r} is not valid; give a number of pieces >= 1, or 'auto'")
    if backend == "onnx-mlir":
        tools = find_onnx_mlir()
    else:
        if pieces not in ("auto", 1):
            raise InvalidOptionError(f"pieces={pieces!r} is for backend='onnx-mlir' only; IREE compiles a graph whole")
        require_iree()
    graph = read_model(model)
    proto = graph if gradients else _without_gradients(graph)  # a copy: the caller's model stays whole
    report = progress or (lambda line: None)
    start = time.perf_counter()
    target_cpu = _HOST_CPU[backend] if target_cpu in _HOST_CPU.values() else target_cpu
    if backend == "onnx-mlir":
        flags = [*_ONNX_MLIR_FLAGS, *([f"--mcpu={target_cpu}"] if target_cpu else []), *extra_args]
        ready = _for_onnx_mlir(proto)
        count = auto_count(ready, NODES_PER_PIECE) if pieces == "auto" else int(pieces)
        if count == 1 and not in_place:
            module = _onnx_mlir(tools.compiler, ready, flags, report, start, timeout)
        else:  # in_place: an archive, whose manifest tells the session
            module = _onnx_mlir_pieces(tools.compiler, ready, count, flags, report, start, timeout, in_place)
        return _compiled(CompiledModel(module, backend, time.perf_counter() - start, _initial_state(model), graph),
                         output)
    import iree.compiler.tools as iree_tools

    report(f"import: {len(proto.graph.node)} ONNX nodes -> MLIR (torch-mlir's ONNX importer)")
    mlir = step_in_two_calls(proto) if in_place else to_mlir(proto)
    report(f"import: done ({time.perf_counter() - start:.1f} s)")
    report(f"compile: iree-compile, llvm-cpu, target cpu {target_cpu}")
    try:
        vmfb = iree_tools.compile_str(
            mlir,
            input_type="onnx",
            target_backends=["llvm-cpu"],
            extra_args=[*_IREE_FLAGS, f"--iree-llvmcpu-target-cpu={target_cpu or 'host'}", *extra_args],
        )
    except iree_tools.CompilerToolError as exc:
        report(f"compile: failed ({time.perf_counter() - start:.1f} s)")
        diagnostics = compiler_diagnostics(str(exc), proto)
        report_text = str(exc).split("Diagnostics:\n", 1)[-1]
        raise CompileError(_describe_failure("IREE", diagnostics, report_text, proto), diagnostics) from exc
    report(f"compile: done ({time.perf_counter() - start:.1f} s in all)")
    return _compiled(CompiledModel(vmfb, backend, time.perf_counter() - start, _initial_state(model), graph), output)


def _compiled(compiled: CompiledModel, output: str | os.PathLike | None) -> CompiledModel:
    if output is not None:
        compiled.save(output)
    return compiled


_PHASE = re.compile(r"^\[(\d+)/(\d+)\] .*? \(\d+s\) (.*)$")  # onnx-mlir: "[2/6] <date> (0s) Compiling and Optimizing ..."
_LOADER = re.compile(r"error while loading shared libraries: (\S+)")


def _for_onnx_mlir(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` in forms onnx-mlir computes right (the same values): outputs unaliased, and MatMul
    operands that are reshaped transposes copied where the graph has a symbolic dim."""
    return _copied_matmul_operands(_unaliased_outputs(model))


def _copied_matmul_operands(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each MatMul operand that is ``Reshape(Transpose(...))`` copied first,
    ``Expand(operand, Shape(operand))``, when an input has a symbolic dim: onnx-mlir reads such an operand
    with the wrong strides once a symbolic dim is above 1 (silently wrong rows;
    tests/repros/onnx_mlir_transpose_reshape_matmul.py). A copy it does not fold makes it read a plain buffer."""
    symbolic = any(not dim.HasField("dim_value") for value in model.graph.input for dim in value.type.tensor_type.shape.dim)
    producer = {out: node for node in model.graph.node for out in node.output}

    def reshaped_transpose(name: str) -> bool:
        node = producer.get(name)
        return node is not None and node.op_type == "Reshape" and getattr(producer.get(node.input[0]), "op_type", "") == "Transpose"

    operands = {name for node in model.graph.node if node.op_type == "MatMul" for name in node.input if reshaped_transpose(name)}
    if not symbolic or not operands:
        return model
    model = copy.deepcopy(model)
    nodes = []
    for node in model.graph.node:
        if node.op_type == "MatMul":
            node.input[:] = [f"{name}/copy" if name in operands else name for name in node.input]
        nodes.append(node)
        for name in node.output:
            if name in operands:
                nodes += _expand_copy(name, f"{name}/copy", name)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    return model


def _expand_copy(value: str, copy_name: str, stem: str) -> list[onnx.NodeProto]:
    """``copy_name`` = ``Expand(value, Shape(value))``: a copy of ``value`` that onnx-mlir does not fold
    (nodes ``<stem>/copy/shape`` and ``<stem>/copy``)."""
    shape = f"{stem}/copy/shape"
    return [onnx.helper.make_node("Shape", [value], [shape], name=shape),
            onnx.helper.make_node("Expand", [value, shape], [copy_name], name=f"{stem}/copy")]


# ops whose output onnx-mlir may return as their data input's buffer (views, and folded no-op arithmetic)
_VIEW_OPS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"})
_NEUTRAL = {"Mul": 1.0, "Div": 1.0, "Add": 0.0, "Sub": 0.0}  # op -> the constant operand that leaves x as it is


def _unaliased_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with no two graph outputs one buffer: onnx-mlir returns outputs that are views of one value
    (``Identity``, ``Reshape``, ``Squeeze``/``Unsqueeze``, ``Cast`` to the same type, ``Mul`` by 1, ``Add`` of
    0, chains of them) as tensors that own that one buffer, and the process aborts releasing them
    (tests/repros/onnx_mlir_aliased_outputs.py). Every output but one per value is copied, and every output
    that is a view of a graph input (a piece's, ``bridge.tools.pieces``): ``Expand(output, Shape(output))``,
    which onnx-mlir does not fold."""
    producer = {out: node for node in model.graph.node for out in node.output}
    constants = {init.name: init for init in model.graph.initializer}
    constants.update({node.output[0]: attribute.t for node in model.graph.node if node.op_type == "Constant"
                      for attribute in node.attribute if attribute.name == "value"})

    def neutral(name: str, value: float) -> bool:
        return name in constants and bool(np.all(onnx.numpy_helper.to_array(constants[name]) == value))

    def source(node: onnx.NodeProto) -> str | None:
        """The input ``node``'s output may alias, if any."""
        if node.op_type in _VIEW_OPS:
            return node.input[0]
        if node.op_type in _NEUTRAL and len(node.input) == 2:
            if neutral(node.input[1], _NEUTRAL[node.op_type]):
                return node.input[0]
            if node.op_type in ("Mul", "Add") and neutral(node.input[0], _NEUTRAL[node.op_type]):
                return node.input[1]
        return None

    def root(name: str) -> str:
        while name in producer and (aliased := source(producer[name])) is not None:
            name = aliased
        return name

    names = [output.name for output in model.graph.output]
    # an output that is its value owns it; a view of a graph input is copied (the caller owns the input)
    claimed = {name for name in names if root(name) == name} | {value.name for value in model.graph.input}
    copies = set()
    for name in names:
        value = root(name)
        if name == value:
            continue
        if value in claimed:
            copies.add(name)
        claimed.add(value)
    if not copies:
        return model
    model = copy.deepcopy(model)
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        for index, name in enumerate(node.output):
            if name in copies:
                view = node.output[index] = f"{name}/aliased"
                nodes += _expand_copy(view, name, name)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    return model


def _onnx_mlir_pieces(compiler: Path, proto: onnx.ModelProto, count: int, flags: list[str], report: Progress,
                      start: float, timeout: float | None, in_place: bool = False) -> bytes:
    """``proto`` cut into ``count`` pieces (``in_place``: its optimizer phase into more, ``state_bounded_cuts``),
    compiled in parallel (one onnx-mlir per core), packed into one archive (``pack_pieces``, with ``in_place``).
    The first failure stops the other compiles."""
    try:
        pieces = [_unaliased_outputs(piece.model)
                  for piece in split(proto, count, state_share=STATE_SHARE_PER_PIECE if in_place else None)]
    except UntypedCutError as exc:
        raise CompileError(f"onnx-mlir could not compile the model in pieces: {exc}", [(exc.node, exc.op, exc.reason)]) from exc
    workers = min(len(pieces), os.cpu_count() or 1)
    report(f"onnx-mlir: {len(proto.graph.node)} ONNX nodes in {len(pieces)} pieces "
           f"({', '.join(str(len(piece.graph.node)) for piece in pieces)} nodes), {workers} compiling at a time")
    running: set[subprocess.Popen] = set()

    def compile_piece(index: int) -> bytes:
        def piece_report(line: str) -> None:
            report(f"piece {index + 1}/{len(pieces)}: {line}")
        return _onnx_mlir(compiler, pieces[index], flags, piece_report, start, timeout, running)

    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(compile_piece, index) for index in range(len(pieces))]
        try:
            libraries = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            for process in list(running):
                _stop(process)
            raise
    return pack_pieces(libraries, [value.name for value in proto.graph.input], [value.name for value in proto.graph.output],
                       in_place)


def _onnx_mlir(compiler: Path, proto: onnx.ModelProto, flags: list[str], report: Progress, start: float,
               timeout: float | None = None, running: set[subprocess.Popen] | None = None) -> bytes:
    """``proto`` compiled by onnx-mlir into a model library (the ``.so``'s bytes); its phase lines reported;
    stopped ``timeout`` seconds after ``start``. onnx-mlir runs in its own process group, so that a timeout
    or an interrupt also stops the opt, llc and clang++ it starts; it is in ``running`` while it runs."""
    with tempfile.TemporaryDirectory(prefix="bridge-onnx-mlir-") as folder, contextlib.ExitStack() as stack:
        if is_large(proto):  # past protobuf's 2 GiB: onnx-mlir reads the external data beside the file
            source = stack.enter_context(external_copy(proto))
        else:
            source = os.path.join(folder, "model.onnx")
            Path(source).write_bytes(proto.SerializeToString())
        # the symbols' tag (onnx-mlir names it after the output file): unique per graph and flags, so that several
        # libraries (a step's two halves, one graph compiled for two CPUs) live in one process: with a shared tag
        # the library loaded second would run the first one's functions
        tag = hashlib.sha256(f"{model_digest(proto)} {' '.join(flags)}".encode()).hexdigest()[:16]
        base = os.path.join(folder, f"bridge_{tag}")
        report(f"onnx-mlir: {len(proto.graph.node)} ONNX nodes, {' '.join(flags)}")
        log, phases, expired = [], ["none reported"], threading.Event()
        with subprocess.Popen([str(compiler), *flags, source, "-o", base], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", start_new_session=True) as process:
            watchdog = None if timeout is None else threading.Timer(
                max(start + timeout - time.perf_counter(), 0.0), lambda: (expired.set(), _stop(process)))
            if running is not None:
                running.add(process)
            try:
                if watchdog:
                    watchdog.start()
                for line in process.stdout:
                    log.append(line.rstrip("\n"))
                    phase = _PHASE.match(log[-1])
                    if phase:
                        phases.append(f"[{phase[1]}/{phase[2]}] {phase[3]}")
                        report(f"onnx-mlir {phases[-1]} ({time.perf_counter() - start:.1f} s)")
                process.wait()
            except BaseException:
                _stop(process)
                raise
            finally:
                if watchdog:
                    watchdog.cancel()
                if running is not None:
                    running.discard(process)
        if expired.is_set() and process.returncode != 0:
            report(f"onnx-mlir: stopped after {timeout:g} s")
            raise CompileError(f"onnx-mlir ran past the timeout of {timeout:g} s compiling graph '{proto.graph.name}' "
                               f"({len(proto.graph.node)} ONNX nodes; last phase: {phases[-1]}) and was stopped; "
                               "give a longer timeout= (bridge compile --timeout)")
        if process.returncode != 0:
            report(f"onnx-mlir: failed ({time.perf_counter() - start:.1f} s)")
            raise _onnx_mlir_failure(process.returncode, "\n".join(log), proto)
        report(f"onnx-mlir: done ({time.perf_counter() - start:.1f} s in all)")
        return Path(base + ".so").read_bytes()


def _stop(process: subprocess.Popen) -> None:
    """Kill ``process``'s group (onnx-mlir and the LLVM tools it runs); nothing if it has ended."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _onnx_mlir_failure(returncode: int, log: str, proto: onnx.ModelProto) -> BridgeError:
    """The error for a failed onnx-mlir run: a missing shared library, a crash, or its diagnostics by node."""
    library = _LOADER.search(log)
    if library:
        return OnnxMlirNotFoundError(f"onnx-mlir does not start, {library[1]} is missing: {INSTALL_HINT}")
    diagnostics = onnx_mlir_diagnostics(log, proto)
    if returncode < 0:
        tail = " ".join(log.splitlines()[-3:])[-300:]
        return CompileError(f"onnx-mlir crashed (signal {-returncode}) compiling graph '{proto.graph.name}'"
                            f"{f': {tail}' if tail else ''}", diagnostics)
    return CompileError(_describe_failure("onnx-mlir", diagnostics, log[-1000:], proto), diagnostics)


def _without_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its ``grad_*`` graph outputs."""
    lean = onnx.ModelProto()
    with outputs_dropped(model, is_gradient):
        lean.CopyFrom(model)
    return lean


def _input_specs(model: onnx.ModelProto) -> dict[str, list]:
    """Each graph input's ``[shape (a symbolic dim: None), numpy dtype name]``, from which the runner
    draws the noise inputs (``bridge.contract.RANDOM_INPUTS``) each step."""
    return {
        v.name: [
            [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim],
            onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
        ]
        for v in model.graph.input
    }


def _initial_state(model) -> dict[str, np.ndarray] | None:
    """The initial state of a ``TrainingModel`` (None for a ModelProto or a path)."""
    initial_state = getattr(model, "initial_state", None)
    return initial_state() if callable(initial_state) else None


_ERROR = re.compile(r"error: (.*)")
_LOCATION = re.compile(r"loc\((?:[^()]|\([^()]*\))*\)")
_QUOTED = re.compile(r'"([^"]+)"')


def compiler_diagnostics(report: str, model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """Each ``error:`` of an iree-compile report as ``(node name, op type, message)``.

    A diagnostic's MLIR location is the ONNX node's name, plain (``loc("name")``) or nested in
    fused/callsite locations; the first quoted name that is a node of ``model`` is the node."""
    diagnostics = report.split("Diagnostics:\n", 1)[-1].split("\n\nInvoked with:", 1)[0]
    nodes = {node.name: node for node in model.graph.node}
    found = []
    for line in diagnostics.splitlines():
        error = _ERROR.search(line)
        if not error:
            continue
        message = _LOCATION.sub("", error.group(1)).lstrip(": ")
        message = message.split(": %", 1)[0].split(" %", 1)[0][:300]
        names = [name for name in _QUOTED.findall(line) if name in nodes]
        node = nodes[names[0]] if names else None
        found.append((node.name if node else "", node.op_type if node else "", message))
    return found


_OP_ERROR = re.compile(r"'(?:onnx|krnl|zhigh)\.(\w+)' op (.*)")  # onnx-mlir: "'onnx.Mul' op <message>: %1 = ..."
_NOT_LOWERED = re.compile(r"failed to legalize operation '(?:onnx|krnl|zhigh)\.(\w+)'")  # no lowering for the op's form
_NODE_NAME = re.compile(r'onnx_node_name = "([^"]+)"|loc\("([^"]+)"')


def onnx_mlir_diagnostics(log: str, model: onnx.ModelProto) -> list[tuple[str, str, str]]:
    """Each distinct op error in an onnx-mlir log as ``(node name, op type, message)``.

    onnx-mlir prints ``'onnx.<Op>' op <message>``, often followed by the op and its ``onnx_node_name``
    (or location ``loc("name")``); ``failed to legalize operation 'onnx.<Op>'`` names none. A line that names
    no node is about the last node named for that op type, else about the graph's only node of that type."""
    nodes = {node.name: node for node in model.graph.node}
    of_type: dict[str, list[str]] = {}
    for node in model.graph.node:
        of_type.setdefault(node.op_type, []).append(node.name)
    last: dict[str, str] = {}  # op type -> the last node of that type a line named
    found: list[tuple[str, str, str]] = []
    for line in log.splitlines():
        error, not_lowered = _OP_ERROR.search(line), _NOT_LOWERED.search(line)
        if error:
            op, message = error[1], error[2].split(": %", 1)[0].strip()[:300]
        elif not_lowered:
            op, message = not_lowered[1], not_lowered[0]
        else:
            continue
        names = [a or b for a, b in _NODE_NAME.findall(line) if (a or b) in nodes]
        if names:
            last[op] = names[0]
        only = of_type.get(op, [])
        name = names[0] if names else last.get(op, only[0] if len(only) == 1 else "")
        entry = (name, nodes[name].op_type if name else op, message)
        if entry not in found:
            found.append(entry)
    return found


def _describe_failure(compiler: str, diagnostics: list[tuple[str, str, str]], report: str, model: onnx.ModelProto) -> str:
    """The compiler's errors, each with the ONNX node (name, op type, bridge layer) it is about."""
    layers = {node.name: props(node.metadata_props).get(LAYER) for node in model.graph.node}
    lines = []
    for name, op, message in diagnostics:
        layer = f", layer {layers[name]}" if layers.get(name) else ""
        lines.append(f"{f'node {name!r} ({op}{layer})' if name else 'the graph'}: {message}")
    if not lines:
        lines = [report.strip()[:1000]]
    more = f"\n  ... and {len(lines) - _MAX_ERRORS} more" if len(lines) > _MAX_ERRORS else ""
    return f"{compiler} could not compile the model:\n  " + "\n  ".join(lines[:_MAX_ERRORS]) + more
