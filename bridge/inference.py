"""Back to inference: the source model with trained values in its initializers."""
from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import BridgeError

TRAINED_SUFFIX = ".trained"


def with_trained_values(source: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``source`` whose initializers hold ``values`` (by name).

    Inputs, outputs, nodes and value names are kept. A name that is not an initializer of
    ``source`` but the output of ``Identity(initializer)`` (a running statistic that a legacy
    exporter shared with an equal tensor; bridge trains it as its own buffer) gets its own
    initializer ``<name>.trained``, read by that Identity, so the shared tensor is untouched.
    """
    model = onnx.ModelProto()
    model.CopyFrom(source)
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    identities = {node.output[0]: node for node in graph.node
                  if node.op_type == "Identity" and node.input[0] in initializers}
    for name, value in values.items():
        if name in initializers:
            initializers[name].CopyFrom(_tensor(value, initializers[name], name))
        elif name in identities:
            node = identities[name]
            tensor = _tensor(value, initializers[node.input[0]], name + TRAINED_SUFFIX)
            graph.initializer.append(tensor)
            node.input[0] = tensor.name
        else:
            raise BridgeError(f"trained value '{name}' is neither an initializer of the source model "
                              "nor an Identity of one; cannot write it back")
    return model


def _tensor(value: np.ndarray, like: onnx.TensorProto, name: str) -> onnx.TensorProto:
    """``value`` as a TensorProto named ``name``, checked against the initializer it replaces."""
    if tuple(value.shape) != tuple(like.dims):
        raise BridgeError(f"trained value '{name}' has shape {list(value.shape)}, the source initializer "
                          f"'{like.name}' {list(like.dims)}")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(like.data_type)
    return numpy_helper.from_array(np.ascontiguousarray(value, dtype=dtype), name)
