"""docs/models.md lists exactly the ops the converter registry supports."""
from __future__ import annotations

from generated_docs import assert_generated_block_current


def test_models_doc_op_table_is_the_registry():
    assert_generated_block_current("supported_ops.py", "models.md", "table")


def test_models_doc_onnx_mlir_zoo_table_is_current():
    assert_generated_block_current("onnx_mlir_zoo.py", "models.md", "table")
