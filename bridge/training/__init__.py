"""The training runtime and lifecycle: sessions on onnxruntime and IREE, the Trainer, checkpoints, data parallel, back to inference."""
