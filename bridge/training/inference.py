"""Back to inference: the source model with trained values in its initializers.

A model exported in training mode (torch's ``TrainingMode.TRAINING`` keeps BatchNormalization
and Dropout as nodes) is put in inference mode without changing its ops: BatchNormalization's
``training_mode`` becomes 0 (its unused running-statistic outputs are dropped) and Dropout's
``training_mode`` input is removed (the default: off). That is the form bridge's eval graph
computes, so the exported model gives the eval graph's outputs.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from ..contract import ROLE, STATE_ROLES, Role, props
from ..errors import BridgeError
from ..onnx_file import all_nodes, graph_reads

TRAINED_SUFFIX = ".trained"


def with_trained_values(source: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``source`` in inference mode whose initializers hold ``values`` (by name).

    Inputs, outputs, nodes and value names are kept. A name that is not an initializer of
    ``source`` but the output of ``Identity(initializer)`` (a running statistic that a legacy
    exporter shared with an equal tensor; bridge trains it as its own buffer) gets its own
    initializer ``<name>.trained``, read by that Identity, so the shared tensor is untouched.
    A weight that the file keeps in a ``Constant`` node (paddle2onnx; spox inside If branches) or in
    a float-list attribute ``<node>.<attribute>`` (ai.onnx.ml's coefficients) is written there.
    """
    model = onnx.ModelProto()
    model.CopyFrom(source)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    identities = {node.output[0]: node for node in graph.node
                  if node.op_type == "Identity" and node.input[0] in initializers}
    constants = {node.output[0]: node.attribute[0] for node in all_nodes(graph)
                 if node.op_type == "Constant" and [a.name for a in node.attribute] == ["value"]}
    attributes = {f"{node.name}.{a.name}": a for node in graph.node for a in node.attribute
                  if node.name and a.type == onnx.AttributeProto.FLOATS}
    for name, value in values.items():
        if name in initializers:
            initializers[name].CopyFrom(_tensor(value, initializers[name], name))
        elif name in identities:
            node = identities[name]
            tensor = _tensor(value, initializers[node.input[0]], name + TRAINED_SUFFIX)
            graph.initializer.append(tensor)
            node.input[0] = tensor.name
        elif name in constants:
            constants[name].t.CopyFrom(_tensor(value, constants[name].t, name))
        elif name in attributes and np.size(value) == len(attributes[name].floats):
            attributes[name].floats[:] = np.asarray(value, np.float32).reshape(-1).tolist()
        else:
            raise BridgeError(f"trained value '{name}' is neither an initializer of the source model, an Identity "
                              "of one, a Constant's value nor a float-list attribute; cannot write it back")
    inference_mode(model)
    return model


def from_checkpoint(source: onnx.ModelProto, training: onnx.ModelProto, checkpoint: str | os.PathLike,
                    merge: bool = True) -> onnx.ModelProto:
    """``source`` with the weights and buffers of a checkpoint of the training graph ``training``
    (refused if the checkpoint belongs to another graph); a LoRA graph's adapters merged in (``merge``)
    or kept beside the base weights."""
    from ..lora import lora_inference, plan_of
    from .checkpoint import read_checkpoint
    from .runtime import graph_hash

    roles = {v.name: props(v.metadata_props).get(ROLE) for v in training.graph.input}
    state_names = {name for name, role in roles.items() if role in STATE_ROLES}
    state, _ = read_checkpoint(checkpoint, graph_hash(training), state_names)
    trained = {name: state[name] for name, role in roles.items() if role in (Role.WEIGHT, Role.BUFFER)}
    plan = plan_of(training)
    if plan is not None:
        source = lora_inference(source, plan, trained, merge)
    return with_trained_values(source, trained)


def inference_mode(model: onnx.ModelProto) -> None:
    """Turn BatchNormalization and Dropout nodes to inference mode (in place); see the module doc.
    A Dropout's ``training_mode`` that nothing else reads goes with it (its Constant node or
    initializer), so runtimes find no unused value in the written model."""
    graph = model.graph
    used = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    removed: set[str] = set()
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            extra = [name for name in node.output[1:] if name]
            if any(name in used for name in extra):
                raise BridgeError(f"BatchNormalization node '{node.name}': its batch statistics {extra} are read by "
                                  "the model, so it cannot be written back in inference mode")
            del node.output[1:]
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
        elif node.op_type == "Dropout" and len(node.input) > 2:
            removed.update(node.input[2:])
            del node.input[2:]
    _drop_unread(graph, removed)


def _drop_unread(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the Constant nodes, initializers and value infos among ``names`` that no node (in
    any subgraph), graph output or graph input reads or declares any more."""
    unread = names - graph_reads(graph) - {out.name for out in graph.output} - {inp.name for inp in graph.input}
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if node.op_type == "Constant" and node.output[0] in unread:
            del graph.node[index]
    for items in (graph.initializer, graph.value_info):
        for index in reversed(range(len(items))):
            if items[index].name in unread:
                del items[index]


def _tensor(value: np.ndarray, like: onnx.TensorProto, name: str) -> onnx.TensorProto:
    """``value`` as a TensorProto named ``name``, checked against the initializer it replaces."""
    if tuple(value.shape) != tuple(like.dims):
        raise BridgeError(f"trained value '{name}' has shape {list(value.shape)}, the source initializer "
                          f"'{like.name}' {list(like.dims)}")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(like.data_type)
    return numpy_helper.from_array(np.ascontiguousarray(value, dtype=dtype), name)
