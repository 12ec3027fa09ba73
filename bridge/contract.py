"""The training-graph contract: every name, role, phase and key a training graph carries (docs/ir.md).

The writer (trace, export, annotate) and the readers (runtime, ir, show, check, compile) import
these from here, so the contract is spelled once. This module imports only the standard library:
reading a saved training graph never needs torch.

- Graph inputs and outputs are named after what they are: ``grad_<weight>``, ``updated_<state>``,
  ``<weight>.<slot>``, ``output_<model output>``, ``step``, ``lr``, ``target``, ``loss``; each has
  a ``bridge.role`` (``Role``).
- Every node has ``bridge.phase`` (``Phase``), ``bridge.layer`` and ``bridge.kind`` (``TAG_KEYS``).
- The model has metadata under ``MODEL_KEYS``.
- ``StepSignature`` is the flat argument and result order of one step (and of its eval,
  gradient and update graphs); ``flatten``/``unflatten`` convert between it and names.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

T = TypeVar("T")


class Phase:
    """Values of the ``bridge.phase`` tag, in execution order (``PHASES``)."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


PHASES = (Phase.FORWARD, Phase.LOSS, Phase.BACKWARD, Phase.OPTIMIZER)


class Role:
    """Values of ``bridge.role`` on graph inputs, outputs and intermediate values."""

    INPUT = "input"
    TARGET = "target"
    WEIGHT = "weight"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    HYPERPARAMETER = "hyperparameter"
    RANDOM = "random"
    GRADIENT = "gradient"
    LOSS = "loss"
    UPDATED = "updated"
    OUTPUT = "output"
    ACTIVATION = "activation"
    UPDATE = "update"


INPUT_ROLES = (Role.INPUT, Role.TARGET, Role.WEIGHT, Role.BUFFER, Role.OPTIMIZER_STATE, Role.HYPERPARAMETER,
               Role.RANDOM, Role.GRADIENT)
OUTPUT_ROLES = (Role.LOSS, Role.GRADIENT, Role.UPDATED, Role.OUTPUT)
# The role of an intermediate value (value_info), by the phase of the node that computes it.
VALUE_ROLES = {Phase.FORWARD: Role.ACTIVATION, Phase.LOSS: Role.ACTIVATION, Phase.BACKWARD: Role.GRADIENT,
               Phase.OPTIMIZER: Role.UPDATE}
STATE_ROLES = (Role.WEIGHT, Role.BUFFER, Role.OPTIMIZER_STATE, Role.HYPERPARAMETER)  # fed from the session state
DATA_ROLES = (Role.INPUT, Role.TARGET, Role.RANDOM)  # fed with each batch (noise: drawn by the runner)

# -- names of graph inputs and outputs ------------------------------------------------------

TARGET = "target"
STEP = "step"  # float scalar: optimizer steps done so far
LR = "lr"
LOSS = "loss"
GRAD_PREFIX = "grad_"
UPDATED_PREFIX = "updated_"
OUTPUT_PREFIX = "output_"
LOSS_LAYER = "loss"  # the bridge.layer of the loss's nodes and of its own backward
LOSS_SCALE = "loss_scale"  # float scalar: the dynamic loss scale of mixed precision (torch.amp.GradScaler's scale)
GROWTH_TRACKER = "loss_scale_growth_tracker"  # float scalar: good steps since the scale last changed
LOSS_SCALING = (LOSS_SCALE, GROWTH_TRACKER)


def grad_name(value: str) -> str:
    """``grad_<value>``: the gradient of the loss with respect to ``value`` (a weight or an activation)."""
    return GRAD_PREFIX + value


def updated_name(state: str) -> str:
    """``updated_<state>``: the output that replaces state input ``state`` at the next step."""
    return UPDATED_PREFIX + state


def output_name(model_output: str) -> str:
    """``output_<model_output>``: the step output that carries the model output ``model_output``."""
    return OUTPUT_PREFIX + model_output


def slot_name(weight: str, slot: str) -> str:
    """``<weight>.<slot>``: the optimizer state input ``slot`` (torch.optim's state key) of ``weight``."""
    return f"{weight}.{slot}"


def strip_prefix(name: str, prefix: str) -> str:
    """``name`` without ``prefix`` (``strip_prefix("updated_fc.weight", UPDATED_PREFIX)`` -> ``fc.weight``)."""
    if not name.startswith(prefix):
        raise ValueError(f"'{name}' does not start with '{prefix}'")
    return name[len(prefix):]


# -- annotation keys ------------------------------------------------------------------------

ROLE = "bridge.role"  # on graph inputs, outputs and value_info
PHASE, LAYER, KIND = "bridge.phase", "bridge.layer", "bridge.kind"  # on every node
TAG_KEYS = (PHASE, LAYER, KIND)

# model metadata_props
VERSION = "bridge.version"
LOSS_NAME = "bridge.loss"
LOSS_OPTIONS = "bridge.loss_options"  # JSON object
OPTIMIZER_NAME = "bridge.optimizer"
OPTIMIZER_OPTIONS = "bridge.optimizer_options"  # JSON object, every torch.optim default filled in
SOURCE_MODEL = "bridge.source_model"  # the source graph's name
SOURCE_SHA256 = "bridge.source_sha256"
RANDOM_INPUTS = "bridge.random_inputs"  # JSON list of the noise inputs (encode_random_inputs)
DIM_BOUNDS = "bridge.dim_bounds"  # JSON {dim name: the largest size the graph holds for}
TARGET_CLASSES = "bridge.target_classes"  # JSON {"classes", "ignore_index", "axis"} of class-index targets
LOSS_OUTPUT = "bridge.loss_output"  # the model output the loss applies to
LORA_PLAN = "bridge.lora_plan"  # JSON LoraPlan of a LoRA conversion (bridge/lora.py)
PRECISION = "bridge.precision"  # JSON {"precision", "grad_scaler"} of a mixed-precision graph
MEMORY = "bridge.memory"  # "min": the backward recomputes values the forward computed (memory="min")
MODEL_KEYS = (VERSION, LOSS_NAME, LOSS_OPTIONS, OPTIMIZER_NAME, OPTIMIZER_OPTIONS, SOURCE_MODEL, SOURCE_SHA256,
              RANDOM_INPUTS, DIM_BOUNDS, TARGET_CLASSES, LOSS_OUTPUT, LORA_PLAN, PRECISION, MEMORY)

DIM_NAMES = "bridge.dim_names"  # torch.fx.GraphModule.meta only: {sympy symbol: dim name}

# source-model metadata_props that bridge reads
PADDING_IDX = "bridge.padding_idx"  # on a Gather (axis 0) of an embedding table: the row that gets no gradient
BATCH_NORM = "bridge.batch_norm"  # on the model: "frozen", the module's BatchNorms were in eval() (export_for_training)

# IREE reflection of a compiled module (bridge.compile): graph input/output names and input specs
INPUTS = "bridge.inputs"  # JSON list of input names, in argument order
OUTPUTS = "bridge.outputs"  # JSON list of output names, in result order
INPUT_SPECS = "bridge.input_specs"  # JSON {name: [shape (an int, or None: symbolic), numpy dtype name]}
IN_PLACE = "bridge.in_place"  # JSON list of the state inputs the step overwrites with their updated_* value
PIECE = "bridge.piece"  # JSON {"index", "inputs", "outputs"}: a function the step runs in turn, and the step's names


def encode_random_inputs(names: Iterable[str]) -> str:
    """The payload of ``RANDOM_INPUTS`` (model metadata and IREE reflection alike): a JSON list of names."""
    return json.dumps(list(names))


def decode_random_inputs(metadata: Mapping[str, str]) -> list[str]:
    """The noise inputs named in ``metadata`` (model metadata or IREE reflection); none when absent."""
    return json.loads(metadata.get(RANDOM_INPUTS, "[]"))


def props(entries) -> dict[str, str]:
    """``metadata_props`` (of a model, node or value) as a dict."""
    return {entry.key: entry.value for entry in entries}


def node_prefix(tags: Mapping[str, str]) -> str:
    """``<phase>_<kind>/<layer>/``: the start of the name of a node with these tags (a leading ``/``
    of the layer is dropped)."""
    phase, kind = tags.get(PHASE, ""), tags.get(KIND, "")
    layer = tags.get(LAYER, "").lstrip("/")
    prefix = f"{phase}_{kind}" if kind else phase
    return f"{prefix}/{layer}/" if layer else f"{prefix}/"


# -- what each role and key means (rendered into docs/ir.md by docs/contract_tables.py) ---------

ROLE_DOCS: dict[str, tuple[str, str]] = {  # role -> (the values that have it, what they are)
    Role.INPUT: ("the source model's data input names (`x`, `image`, ...)",
                 "same names and dtypes as the inference model"),
    Role.TARGET: (f"`{TARGET}`", "the label (class indices for `ce`, same shape as the output for `mse`, ...)"),
    Role.WEIGHT: ("every trainable initializer, under its ORIGINAL name (`fc.weight`)",
                  "a weight shared by several nodes is one input with one gradient"),
    Role.BUFFER: ("normalization running statistics (`bn1.running_mean`)",
                  "updated by the forward pass in training mode"),
    Role.OPTIMIZER_STATE: (f"`<weight>.<slot>` with torch.optim's state keys (`fc.weight.exp_avg`, ...); `{STEP}`; "
                           f"with loss scaling `{LOSS_SCALE}` and `{GROWTH_TRACKER}`",
                           f"`{STEP}` is a float32 scalar: steps done so far; `{LOSS_SCALE}` the loss scale, "
                           f"`{GROWTH_TRACKER}` the good steps since it last changed (docs/finetuning.md)"),
    Role.HYPERPARAMETER: (f"`{LR}` (float scalar)", "change it between steps for a schedule"),
    Role.RANDOM: ("`<node>.noise` for each training-mode random op (Dropout)",
                  "uniform [0, 1) noise the runner draws fresh every step (onnx-mlir would freeze a Random* "
                  "op's seed)"),
    Role.LOSS: (f"output `{LOSS}` (float scalar)", ""),
    Role.GRADIENT: (f"output `{GRAD_PREFIX}<weight>` for every weight (an input of the update graph); "
                    "intermediate values of the backward pass",
                    "the gradient of the loss (before any clipping)"),
    Role.UPDATED: (f"output `{UPDATED_PREFIX}<x>` for every weight, buffer, optimizer state and `{STEP}`",
                   "feed it back as `<x>` at the next step"),
    Role.OUTPUT: (f"output `{OUTPUT_PREFIX}<name>` for the model outputs asked for (`extra_outputs=`, "
                  "the eval graph)", "the model output"),
    Role.ACTIVATION: ("intermediate values of the forward pass and the loss", ""),
    Role.UPDATE: ("intermediate values of the optimizer", ""),
}

KEY_DOCS: dict[str, tuple[str, str]] = {  # key -> (where, the value)
    ROLE: ("graph inputs, outputs, value_info", "the value's role (table above)"),
    PHASE: ("every node", ", ".join(f"`{phase}`" for phase in PHASES)),
    LAYER: ("every node", "forward/backward: the name of the source-model node it computes (or differentiates); "
            f"loss phase and the loss's own backward: `{LOSS_LAYER}`; optimizer: the weight it updates, `{STEP}` "
            "for the step counter, `global` for global-norm gradient clipping (`clip_grad_norm=`)"),
    KIND: ("every node", "the source op in snake_case (`conv`, `batch_normalization`, `gemm`), the loss (`ce`, "
           "`mse`, a callable's name), the optimizer (`adam`, `clip_grad_norm`)"),
    VERSION: ("model", "the bridge version that wrote the graph"),
    LOSS_NAME: ("model", "the loss"),
    LOSS_OPTIONS: ("model", "JSON: the loss's options"),
    OPTIMIZER_NAME: ("model", "the optimizer"),
    OPTIMIZER_OPTIONS: ("model", "JSON: the optimizer's options, every torch.optim default filled in"),
    SOURCE_MODEL: ("model", "the source graph's name"),
    SOURCE_SHA256: ("model", "sha256 of the source model"),
    RANDOM_INPUTS: ("model; IREE reflection", "JSON list of the `random` inputs"),
    DIM_BOUNDS: ("model", "JSON {dim name: the largest size the graph holds for} (docs/dynamic_batch.md)"),
    TARGET_CLASSES: ("model", 'JSON {"classes", "ignore_index", "axis"} of class-index targets'),
    LOSS_OUTPUT: ("model", "the model output the loss applies to"),
    LORA_PLAN: ("model", "JSON: the LoRA adapters trained (rank, alpha, targets, each adapter's weight and scale)"),
    PRECISION: ("model (mixed precision only)", 'JSON {"precision": "fp16" or "bf16", "grad_scaler": the '
                "torch.amp.GradScaler options, or null without loss scaling}"),
    MEMORY: ("model (memory=\"min\" only)", "`min`: the backward recomputes cheap forward values; a runtime "
             "must not merge those nodes back into the forward's (onnxruntime: its CSE pass is off)"),
    INPUTS: ("IREE reflection", "JSON list of the graph input names, in argument order"),
    OUTPUTS: ("IREE reflection", "JSON list of the graph output names, in result order"),
    INPUT_SPECS: ("IREE reflection", "JSON {input name: [shape (a symbolic dim: null), numpy dtype name]}"),
    IN_PLACE: ("IREE reflection (`bridge.compile(in_place=True)`)", "JSON list of the state inputs whose "
               "`updated_*` value the step writes into the input's own buffer (not among the results)"),
    PIECE: ("IREE reflection (`bridge.compile(in_place=True)`)", 'JSON {"index", "inputs", "outputs"}: the '
            "function's place among those a step calls in turn, and the step's input and output names"),
    PADDING_IDX: ("source model: a `Gather` (axis 0) of a 2-D table", "the row that gets no gradient (torch's "
                  "`nn.Embedding(padding_idx=...)`; `export_for_training` writes it, bridge reads it)"),
    BATCH_NORM: ("source model", "`frozen`: the module was in `train()` with its BatchNorms in `eval()`, so "
                 "`to_training_onnx` defaults to `batch_norm=\"frozen\"` (`export_for_training` writes it)"),
}


# -- the step's signature -------------------------------------------------------------------


@dataclass(frozen=True)
class StepSignature:
    """The flat argument and result order of the traced step, and of the graph exported from it.

    Arguments: weights, buffers, optimizer state (``<weight>.<slot>``), ``step``, ``lr`` (the
    state, ``state_names``), then data inputs, noise inputs and ``target`` (``data_names``).
    Results: ``loss``, ``grad_<weight>``, ``updated_<state>`` (all but ``lr``), ``output_<name>``.
    The eval graph (``for_eval``) and the gradient and update graphs (``split``) keep this order
    with fewer names."""

    weights: list[str]
    buffers: list[str]
    state: list[tuple[str, str]]  # (weight, slot)
    inputs: list[str]
    random: list[str] = field(default_factory=list)  # noise inputs of random ops, drawn every step
    outputs: list[str] = field(default_factory=list)  # model outputs returned as ``output_<name>``
    training: bool = True  # False: the eval graph (forward + loss, no update)
    part: str = "step"  # "step": the whole step; "gradient" / "update": its two halves (see ``split``)
    loss_scaling: bool = False  # mixed precision's dynamic loss scale (``LOSS_SCALING``) is state of the step

    def slot_names(self) -> list[str]:
        """``<weight>.<slot>`` of the optimizer state, in ``state`` order."""
        return [slot_name(w, slot) for w, slot in self.state]

    def state_names(self) -> list[str]:
        """Inputs that carry training state: fed from ``initial_state()``, then from ``updated_*``.

        The eval graph reads only the weights and buffers, the gradient graph also the loss scale;
        the update graph the weights, the optimizer state, ``step``, ``lr`` and the loss scaling state."""
        scaling = list(LOSS_SCALING) if self.loss_scaling else []
        if not self.training:
            return self.weights + self.buffers
        if self.part == "gradient":
            return self.weights + self.buffers + scaling[:1]
        if self.part == "update":
            return self.weights + self.slot_names() + [STEP, LR] + scaling
        return self.weights + self.buffers + self.slot_names() + [STEP, LR] + scaling

    def gradient_names(self) -> list[str]:
        """``grad_<w>`` for every trained weight: outputs of the step and gradient graphs,
        inputs of the update graph."""
        return [grad_name(w) for w in self.weights]

    def data_names(self) -> list[str]:
        """The inputs fed with each batch: data inputs, noise inputs, ``target`` (none in the update graph)."""
        if self.part == "update":
            return []
        return self.inputs + self.random + [TARGET]

    def input_names(self) -> list[str]:
        """Every graph input, in argument order."""
        if self.part == "update":
            return self.state_names() + self.gradient_names()
        return self.state_names() + self.data_names()

    def output_names(self) -> list[str]:
        """Every graph output, in result order."""
        extra = [output_name(name) for name in self.outputs]
        if not self.training:
            return [LOSS] + extra
        if self.part == "gradient":
            return [LOSS] + self.gradient_names() + [updated_name(b) for b in self.buffers] + extra
        updated = [updated_name(name) for name in self.state_names() if name != LR]
        if self.part == "update":
            return updated
        return [LOSS] + self.gradient_names() + updated + extra

    def flatten(self, values: Mapping[str, T], *, outputs: bool = False) -> list[T]:
        """``values`` (by name) in argument order (``outputs``: in result order)."""
        names = self.output_names() if outputs else self.input_names()
        missing = [name for name in names if name not in values]
        if missing:
            raise KeyError(f"no value for {missing} of the {self.part} signature")
        return [values[name] for name in names]

    def unflatten(self, flat: Sequence[T], *, outputs: bool = False) -> dict[str, T]:
        """The flat arguments (``outputs``: results) by name."""
        names = self.output_names() if outputs else self.input_names()
        if len(flat) != len(names):
            raise ValueError(f"{len(flat)} values for the {len(names)} {'results' if outputs else 'arguments'} "
                             f"of the {self.part} signature")
        return dict(zip(names, flat, strict=True))

    def for_eval(self, outputs: list[str]) -> StepSignature:
        """The signature of the eval graph: weights, buffers, inputs, target -> loss, ``outputs``."""
        return replace(self, state=[], random=[], outputs=list(outputs), training=False)

    def split(self) -> tuple[StepSignature, StepSignature]:
        """The signatures of the step's two halves: the gradient graph (weights, buffers, inputs,
        noise, target -> loss, ``grad_*``, ``updated_<buffer>``, outputs) and the update graph
        (weights, optimizer state, step, lr, ``grad_*`` -> ``updated_*`` of the weights,
        optimizer state and step)."""
        return replace(self, state=[], part="gradient"), replace(self, inputs=[], random=[], buffers=[],
                                                                 outputs=[], part="update")

    def input_roles(self) -> dict[str, str]:
        """``bridge.role`` of every graph input."""
        roles = {name: Role.WEIGHT for name in self.weights}
        roles.update({name: Role.BUFFER for name in self.buffers})
        roles.update({name: Role.OPTIMIZER_STATE for name in self.slot_names()})
        roles.update({STEP: Role.OPTIMIZER_STATE, LR: Role.HYPERPARAMETER, TARGET: Role.TARGET})
        roles.update({name: Role.OPTIMIZER_STATE for name in LOSS_SCALING if self.loss_scaling})
        roles.update({name: Role.INPUT for name in self.inputs})
        roles.update({name: Role.RANDOM for name in self.random})
        if self.part == "update":
            roles.update({name: Role.GRADIENT for name in self.gradient_names()})
        return roles

    def output_roles(self) -> dict[str, str]:
        """``bridge.role`` of every graph output."""
        roles = {LOSS: Role.LOSS}
        roles.update({name: Role.GRADIENT for name in self.gradient_names()})
        roles.update({name: Role.UPDATED for name in self.output_names() if name.startswith(UPDATED_PREFIX)})
        roles.update({output_name(name): Role.OUTPUT for name in self.outputs})
        return roles
