"""bridge.pipeline.lowering.activation against ATen, eagerly in float64 (end to end: the op database's Relu rows)."""
import pytest
import torch

from bridge.pipeline.lowering.activation import threshold_backward

aten = torch.ops.aten


@pytest.mark.parametrize("threshold", [0.0, 0.25, -0.5])
def test_threshold_backward_matches_aten(threshold):
    """Values exactly at the threshold (and at 0) take no gradient, as in torch."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    x[0, 0, :2] = torch.tensor([threshold, 0.0], dtype=torch.float64)
    grad = torch.randn_like(x)
    assert torch.equal(threshold_backward(grad, x, threshold), aten.threshold_backward(grad, x, threshold))


def test_relu_backward_is_clip_ceil_mul_in_the_graph():
    """The mask is one Clip (both bounds numbers) and a Ceil: no Relu/Min pair in ReLU's backward."""
    import bridge

    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    tm = bridge.to_training_onnx(module, loss="ce", optim="sgd", example_inputs=[torch.randn(4, 6)])
    backward_relu = [n.op_type for n in tm.model.graph.node if n.name.startswith("backward_relu/")]
    assert sorted(backward_relu) == ["Ceil", "Clip", "Mul"]
