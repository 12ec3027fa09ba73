"""The onnx-mlir defects the op database meets: test param id (``<row id>-static`` or ``-symbolic``) ->
the defect and its repro in this folder. tests/test_onnx_mlir_ops.py makes each a strict xfail and
docs/op_database.py counts them in the onnx-mlir column of docs/models.md; docs/onnx-mlir.md lists them."""

OP_DEFECTS: dict[str, str] = {}  # bridge emits a form avoiding each defect met so far (docs/onnx-mlir.md)


def compile_as_is(model, folder: str) -> str:
    """``model`` compiled by ``onnx-mlir --EmitLib -O3`` without bridge.compile's rewrites (which avoid the
    defects shown here): the path of the library written in ``folder``."""
    import os
    import subprocess

    import onnx

    from bridge.training.runtime_onnx_mlir import find_onnx_mlir

    source = os.path.join(folder, "model.onnx")
    onnx.save(model, source)
    subprocess.run([str(find_onnx_mlir().compiler), "--EmitLib", "-O3", source, "-o", os.path.join(folder, "model")],
                   check=True, capture_output=True)
    return os.path.join(folder, "model.so")
