"""ONE reader of ONNX node attributes, shared by the importer's converters and ``bridge.check`` (torch-free)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name``, decoded: strings as ``str``, tensors as numpy
    arrays, ints, floats and their lists as Python values, graphs as ``GraphProto``. ``default``
    when the node has no such attribute (a float default is rounded to float32, as ONNX float
    attributes are)."""
    for entry in node.attribute:
        if entry.name == name:
            value = helper.get_attribute_value(entry)
            if isinstance(value, bytes):
                return value.decode()
            if isinstance(value, onnx.TensorProto):
                return onnx.numpy_helper.to_array(value)
            return value
    if isinstance(default, float):
        return float(np.float32(default))
    return default
