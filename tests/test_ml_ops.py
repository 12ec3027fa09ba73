"""ai.onnx.ml LinearClassifier, Normalizer and ZipMap (bridge/pipeline/importer/ops/ml.py) where the op
database's onnxruntime oracle does not decide: the binary layout and post transforms that onnxruntime
computes otherwise (onnx's reference evaluator is the oracle), the label output, and the refusals."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

import bridge
from bridge.errors import ShapeError, UnsupportedOpError

X = np.random.default_rng(0).standard_normal((4, 3))


def _classifier(coefficients, intercepts, post_transform: str, labels=(0, 1, 2), dtype=T.FLOAT) -> onnx.ModelProto:
    node = h.make_node("LinearClassifier", ["x"], ["label", "scores"], name="lc", domain="ai.onnx.ml",
                       coefficients=list(coefficients), intercepts=list(intercepts), classlabels_ints=list(labels),
                       post_transform=post_transform)
    graph = h.make_graph([node], "classifier", [h.make_tensor_value_info("x", dtype, list(X.shape))],
                         [h.make_tensor_value_info("label", T.INT64, [X.shape[0]]),
                          h.make_tensor_value_info("scores", dtype, [X.shape[0], len(labels)])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("ai.onnx.ml", 1)])


def _eval(model: onnx.ModelProto, x: np.ndarray) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = bridge.to_training_onnx(model, output="scores")
    return tm.session().evaluate({"x": x}, np.zeros(tm.target_shape, tm.target_dtype))


@pytest.mark.parametrize("post_transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_binary_classifier_scores_and_labels_are_the_references(post_transform):
    """One coefficient row and two class labels: the scores are the reference's ``[-s, s]`` transformed,
    in float64 (onnxruntime returns ``[1 - s, s]`` for NONE, SOFTMAX and SOFTMAX_ZERO)."""
    rng = np.random.default_rng(1)
    model = _classifier(rng.uniform(-1, 1, 3), [0.25], post_transform, labels=(3, 7), dtype=T.DOUBLE)
    got = _eval(model, X)
    label, scores = ReferenceEvaluator(model).run(None, {"x": X})
    # the reference writes the binary scores into a float32 array: its own rounding
    np.testing.assert_allclose(got["output_scores"], scores, rtol=2 * np.finfo(np.float32).eps, atol=1e-7)
    np.testing.assert_array_equal(got["output_label"], label)


def test_probit_scores_are_the_references():
    """PROBIT, ``sqrt(2) * erfinv(2p - 1)`` by the reference's approximation, on scores in (0, 1)."""
    rng = np.random.default_rng(2)
    model = _classifier(rng.uniform(-0.05, 0.05, 9), [0.3, 0.5, 0.7], "PROBIT", dtype=T.DOUBLE)
    got = _eval(model, X)
    label, scores = ReferenceEvaluator(model).run(None, {"x": X})
    np.testing.assert_allclose(got["output_scores"], scores, rtol=1e-12)
    np.testing.assert_array_equal(got["output_label"], label)


def test_multiclass_label_is_onnxruntimes():
    rng = np.random.default_rng(3)
    model = _classifier(rng.uniform(-1, 1, 9), rng.uniform(-0.5, 0.5, 3), "SOFTMAX", labels=(10, 20, 30))
    x = X.astype(np.float32)
    got = _eval(model, x)
    label, _ = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got["output_label"], label)


def test_unknown_post_transform_is_refused_naming_the_node():
    with pytest.raises(UnsupportedOpError, match=r"LinearClassifier node 'lc': post_transform 'CUBE'"):
        bridge.to_training_onnx(_classifier(np.ones(9), np.zeros(3), "CUBE"), output="scores")


def test_coefficients_that_do_not_fit_the_input_are_refused():
    with pytest.raises(ShapeError, match=r"'lc': its 12 coefficients for 3 score rows are 4 per row, but its input 'x' has 3"):
        bridge.to_training_onnx(_classifier(np.ones(12), np.zeros(3), "NONE"), output="scores")


def test_rows_that_do_not_match_the_labels_are_refused():
    with pytest.raises(UnsupportedOpError, match=r"'lc': 2 coefficient row\(s\) for 3 class label\(s\)"):
        bridge.to_training_onnx(_classifier(np.ones(6), np.zeros(2), "NONE"), output="scores")


def test_exported_classifier_holds_the_trained_coefficients(tmp_path):
    """export_inference writes the trained coefficients and intercepts back into the LinearClassifier's
    attributes: onnxruntime's run of the written file gives the eval graph's probabilities after a step."""
    rng = np.random.default_rng(4)
    model = _classifier(rng.uniform(-1, 1, 9), rng.uniform(-0.5, 0.5, 3), "SOFTMAX")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tm = bridge.to_training_onnx(model, output="scores", optim_options={"lr": 0.5})
    x = X.astype(np.float32)
    session = tm.session()
    session.step({"x": x}, rng.standard_normal(tm.target_shape).astype(np.float32))
    assert not np.array_equal(session.state["lc.coefficients"], tm.initial_state()["lc.coefficients"])
    want = session.evaluate({"x": x}, np.zeros(tm.target_shape, np.float32))["output_scores"]
    path = tm.export_inference(tmp_path / "trained.onnx", session.state)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["scores"], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # float32 runs of two graphs
