"""Legacy exports de-duplicate equal tensors through Identity nodes: the ONNX model then has one
weight where torch had several. bridge trains it as one tied weight under its original name,
which must equal torch with those parameters tied (one tensor, gradients summed)."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import torch
from zoo.harness import Case, check_case, twin_oracle


def test_identity_deduplicated_weights_train_as_one_tied_weight(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                 torch.nn.Linear(4, 3))
    with torch.no_grad():  # freshly initialised layers often hold equal tensors
        module[0].bias.zero_()
        module[2].bias.zero_()
    path = str(tmp_path / "dedup.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.randn(2, 4),), path, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"])
    graph = onnx.load(path).graph
    aliases = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity"}
    assert aliases == {"2.bias": "0.bias", "3.bias": "0.bias"}, "the exporter's de-duplication changed"
    weights = {init.name: onnx.numpy_helper.to_array(init) for init in graph.initializer}

    def twin(params, inputs):  # torch with the de-duplicated parameters tied
        tied = {name: params[aliases.get(name, name)] for name, _ in module.named_parameters()}
        return torch.func.functional_call(module, tied, (inputs["x"],))

    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((2, 4)).astype(np.float32)}
    target = np.array([0, 2], np.int64)
    lr = 1e-2
    check_case(Case("dedup", path, inputs, target, "ce", set(weights), twin_oracle(twin, weights, inputs, target, "ce", lr),
                    lr=lr))
