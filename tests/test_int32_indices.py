"""int32 indices (tf2onnx's LSTM/GRU text models, jax2onnx): the embedding backward widens them to
int64, a Cast that onnx-mlir's op table lists as unsupported (float <-> double only) but that
onnx-mlir compiles and steps as onnxruntime does, so ``bridge check --target onnx-mlir`` passes it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers.oracle import check_training_step
from helpers.reference import assert_steps_match
from onnx import TensorProto, helper, numpy_helper

import bridge
from bridge.tools.target_check import onnx_mlir_missing

RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 10, (2, 5)).astype(np.int32)
TOLERANCE = 16 * float(np.finfo(np.float32).eps)  # as tests/test_onnx_mlir.py
_MISSING = onnx_mlir_missing()


def _embedding_model() -> onnx.ModelProto:
    """Two embeddings of int32 ids: one gathered with them directly, one through a Cast to int64 and
    back (both directions of the cast in the graph, forward and backward)."""
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e1"]),
             helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
             helper.make_node("Cast", ["ids64"], ["ids32"], to=TensorProto.INT32),
             helper.make_node("Gather", ["emb2", "ids32"], ["e2"]), helper.make_node("Add", ["e1", "e2"], ["e"]),
             helper.make_node("ReduceMean", ["e", "axes"], ["m"], keepdims=0), helper.make_node("MatMul", ["m", "fc"], ["y"])]
    weights = {"emb": RNG.standard_normal((10, 4)), "emb2": RNG.standard_normal((10, 4)), "fc": RNG.standard_normal((4, 3))}
    graph = helper.make_graph(nodes, "int32_embedding", [helper.make_tensor_value_info("ids", TensorProto.INT32, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
                              + [numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _int_casts(model: onnx.ModelProto) -> set[tuple[int, int]]:
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    inferred = onnx.shape_inference.infer_shapes(model)
    types.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info})
    return {(types[n.input[0]], n.attribute[0].i) for n in model.graph.node if n.op_type == "Cast"}


def test_int32_index_casts_pass_the_onnx_mlir_check_and_train():
    tm = bridge.to_training_onnx(_embedding_model(), loss="mse", optim="sgd", target="onnx-mlir")
    assert {(TensorProto.INT32, TensorProto.INT64), (TensorProto.INT64, TensorProto.INT32)} <= _int_casts(tm.model)
    assert list(bridge.check(tm.model, target="onnx-mlir", compile=False)) == []
    assert check_training_step(_embedding_model(), {"ids": IDS}, target="onnx-mlir").failures() == []


def test_a_cast_onnx_mlir_does_not_compile_is_flagged():
    graph = helper.make_graph([helper.make_node("Cast", ["ids"], ["u"], name="to_uint8", to=TensorProto.UINT8)], "cast",
                              [helper.make_tensor_value_info("ids", TensorProto.INT32, [2])],
                              [helper.make_tensor_value_info("u", TensorProto.UINT8, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert [v.problem for v in bridge.check(model, target="onnx-mlir", compile=False)] == [
        "cast from INT32 to UINT8 (onnx-mlir fails to compile it)"]


@pytest.mark.slow
@pytest.mark.onnx_mlir
@pytest.mark.skipif(_MISSING is not None, reason=f"onnx-mlir is not available: {_MISSING}")
def test_onnx_mlir_steps_int32_indices_as_onnxruntime():
    tm = bridge.to_training_onnx(_embedding_model(), loss="mse", optim="sgd", target="onnx-mlir")
    compiled, ort = bridge.compile(tm, backend="onnx-mlir").session(), tm.session(threads=1)
    targets = [RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(3)]
    got = [compiled.step({"ids": IDS}, target) for target in targets]
    want = [ort.step({"ids": IDS}, target) for target in targets]
    assert_steps_match(got, want, rtol=TOLERANCE)
