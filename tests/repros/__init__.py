"""Minimal standalone repros of compiler defects bridge's emitted graphs avoid (docs/onnx-mlir.md)."""
