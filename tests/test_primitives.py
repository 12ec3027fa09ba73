"""bridge/pipeline/primitives.py: ``affine`` computes ``x * scale + bias`` per channel, is traced as one node and
emitted as an inference-form BatchNormalization that onnxruntime runs bit for bit as that Mul and Add."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch.fx.experimental.proxy_tensor import make_fx

from bridge.pipeline.primitives import AFFINE, affine


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 7), (2, 3, 4, 5)])
def test_affine_is_a_per_channel_multiply_add(shape):
    x, scale, bias = torch.randn(shape), torch.randn(3), torch.randn(3)
    broadcast = [1, 3] + [1] * (len(shape) - 2)
    torch.testing.assert_close(affine(x, scale, bias), x * scale.reshape(broadcast) + bias.reshape(broadcast),
                               rtol=0, atol=0)


def test_affine_is_traced_as_one_node():
    graph = make_fx(lambda x, s, b: affine(x, s, b))(torch.randn(2, 3, 4), torch.randn(3), torch.randn(3)).graph
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [AFFINE]


@pytest.mark.parametrize("shape", [(8, 64, 16, 16), (1, 1, 100_003), (33, 7)])
def test_its_batch_normalization_form_is_the_multiply_add_bit_for_bit_in_onnxruntime(shape):
    """The emitter's assumption: mean 0, variance 1, epsilon 0 make onnxruntime's BatchNormalization
    ``x * scale + bias`` rounded as a float32 Mul then Add (no fused multiply-add)."""
    rng = np.random.default_rng(0)
    channels = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    scale, bias = (rng.standard_normal(channels).astype(np.float32) for _ in range(2))
    constants = [numpy_helper.from_array(a, n) for a, n in ((scale, "s"), (bias, "b"), (np.zeros(channels, np.float32), "m"),
                                                          (np.ones(channels, np.float32), "v"))]
    graph = helper.make_graph([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=0.0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    broadcast = [1, channels] + [1] * (len(shape) - 2)
    want = x * scale.reshape(broadcast) + bias.reshape(broadcast)  # float32 products, then float32 sums
    np.testing.assert_array_equal(got, want)
