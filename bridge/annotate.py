"""Stage 6, annotate: roles of graph inputs/outputs and model-level metadata.

Node-level annotations (``bridge.phase``, ``bridge.layer``) are written by the exporter from
the tracer's tags; this pass adds what is known only for the whole graph.
"""
from __future__ import annotations

import json

import onnx

from .losses import Loss
from .optimizers import Optimizer
from .trace import StepSignature

ROLE = "bridge.role"


def input_roles(signature: StepSignature) -> dict[str, str]:
    roles = {name: "weight" for name in signature.weights}
    roles.update({name: "buffer" for name in signature.buffers})
    roles.update({f"{w}.{slot}": "optimizer_state" for w, slot in signature.state})
    roles.update({"step": "optimizer_state", "lr": "hyperparameter", "target": "target"})
    roles.update({name: "input" for name in signature.inputs})
    return roles


def output_roles(signature: StepSignature) -> dict[str, str]:
    roles = {"loss": "loss"}
    roles.update({f"grad_{w}": "gradient" for w in signature.weights})
    roles.update({name: "updated" for name in signature.output_names() if name.startswith("updated_")})
    return roles


def _set(props, key: str, value: str) -> None:
    for entry in props:
        if entry.key == key:
            entry.value = value
            return
    entry = props.add()
    entry.key, entry.value = key, value


def annotate_model(
    model: onnx.ModelProto,
    signature: StepSignature,
    *,
    source_name: str,
    source_hash: str,
    loss: Loss,
    optimizer: Optimizer,
    version: str,
) -> None:
    """Write roles on graph inputs/outputs and the model's metadata (in place)."""
    roles = {**input_roles(signature), **output_roles(signature)}
    for value in list(model.graph.input) + list(model.graph.output):
        _set(value.metadata_props, ROLE, roles[value.name])
    options = {k: (list(v) if isinstance(v, tuple) else v) for k, v in optimizer.options.items()}
    loss_options = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in loss.options.items()}
    metadata = {
        "bridge.version": version,
        "bridge.loss": loss.name,
        "bridge.loss_options": json.dumps(loss_options, sort_keys=True),
        "bridge.optimizer": optimizer.name,
        "bridge.optimizer_options": json.dumps(options, sort_keys=True, default=str),
        "bridge.source_model": source_name,
        "bridge.source_sha256": source_hash,
    }
    for key, value in metadata.items():
        _set(model.metadata_props, key, value)
