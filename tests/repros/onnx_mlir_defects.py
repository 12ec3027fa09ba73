"""The onnx-mlir defects the op database meets: test param id (``<row id>-static`` or ``-symbolic``) ->
the defect and its repro in this folder. tests/test_onnx_mlir_ops.py makes each a strict xfail and
docs/op_database.py counts them in the onnx-mlir column of docs/models.md; docs/onnx-mlir.md lists them."""

OP_DEFECTS: dict[str, str] = {}  # bridge emits a form avoiding each defect met so far (docs/onnx-mlir.md)
