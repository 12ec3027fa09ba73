"""bridge.dtypes (one element-type table) and bridge.attributes (one attribute reader)."""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from bridge import dtypes
from bridge.attributes import attribute


def test_tables_agree_both_ways():
    assert dtypes.TORCH_TO_NUMPY[torch.bfloat16] == dtypes.ONNX_TO_NUMPY[TensorProto.BFLOAT16]
    for onnx_type, torch_dtype in dtypes.ONNX_TO_TORCH.items():
        assert dtypes.TORCH_TO_ONNX[torch_dtype] == onnx_type
        numpy_dtype = dtypes.TORCH_TO_NUMPY[torch_dtype]
        assert dtypes.NUMPY_TO_TORCH[numpy_dtype] is torch_dtype
        if torch_dtype != torch.bfloat16:  # torch reads no ml_dtypes array
            assert torch.from_numpy(np.zeros(2, numpy_dtype)).dtype == torch_dtype


def test_attribute_decodes_and_defaults():
    node = helper.make_node("Resize", ["x"], ["y"], mode="linear", axes=[2, 3], cubic_coeff_a=-0.5,
                            value=onnx.numpy_helper.from_array(np.arange(3, dtype=np.int64)))
    assert attribute(node, "mode") == "linear"
    assert attribute(node, "axes") == [2, 3]
    np.testing.assert_array_equal(attribute(node, "value"), [0, 1, 2])
    assert attribute(node, "missing") is None
    assert attribute(node, "missing", 0.1) == float(np.float32(0.1))
