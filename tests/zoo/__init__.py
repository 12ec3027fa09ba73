"""The model zoo: deterministic real models (random weights, small inputs) and their oracles.

- ``handbuilt``: ONNX models written with ``onnx.helper``, each with an independent torch twin.
- ``torch_models``: torchvision / timm / HF transformers modules from tiny configs.
- ``exporters``: the ways a torch model becomes ONNX (legacy at opsets 13/17 with and without
  constant folding, the dynamo exporter at opset 18+, external data).
- ``harness``: the oracle for a torch module (eager steps with real torch.optim, mapped to
  ONNX initializer names) and the checks every zoo test makes.
"""
