"""The onnx-mlir defects the op database meets: test param id (``<row id>-static`` or ``-symbolic``) ->
the defect and its repro in this folder. tests/test_onnx_mlir_ops.py makes each a strict xfail and
docs/op_database.py counts them in the onnx-mlir column of docs/models.md; docs/onnx-mlir.md lists them."""

_TOPK = ("onnx-mlir defect: TopK along an axis but the last does not compile (failed to legalize 'onnx.TopK'); "
         "tests/repros/onnx_mlir_topk_inner_axis.py")
OP_DEFECTS: dict[str, str] = {
    "ConvTranspose-1d_strided-symbolic": "onnx-mlir defect: a MatMul reading a Reshape of a Transpose that moves the symbolic "
                                         "batch computes wrong rows (grad_W); tests/repros/onnx_mlir_transpose_reshape_matmul.py",
    "TopK-smallest_axis1-static": _TOPK,
    "TopK-smallest_axis1-symbolic": _TOPK,
}
