"""Model outputs that the loss does not use and bridge cannot compute are dropped before the op
check: skl2onnx's ``label`` (ArgMax -> ai.onnx.ml ArrayFeatureExtractor) beside the trained
``probabilities``. The file is a real skl2onnx export (tests/data/make_skl2onnx_mlp.py); the oracle
is float64 finite differences of the original file, ml op included, in ONNX's reference evaluator."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from helpers.oracle import check_training_step

import bridge
from bridge.errors import UnsupportedOpError
from bridge.pipeline.importer.program import DroppedOutputsWarning

SKLEARN_MLP = Path(__file__).parent / "data" / "skl2onnx_mlp_classifier.onnx"
FEATURES = np.random.default_rng(0).uniform(0.1, 7.0, (3, 4)).astype(np.float32)  # iris-like measurements


def test_unused_ml_output_is_dropped_and_the_used_one_trains():
    with pytest.warns(DroppedOutputsWarning, match="'label'"):
        result = check_training_step(onnx.load(SKLEARN_MLP), {"X": FEATURES}, output_index=1, batch_size=3,
                                     dynamic_batch=False)
    assert sorted(result.weights) == ["coefficient", "coefficient1", "intercepts", "intercepts1"]
    assert result.failures() == []


def test_eval_graph_leaves_the_dropped_output_out_and_the_inference_export_keeps_it(tmp_path):
    with pytest.warns(DroppedOutputsWarning):
        tm = bridge.to_training_onnx(str(SKLEARN_MLP), output="probabilities", loss="mse", batch_size=3,
                                     dynamic_batch=False)
    assert "output_label" not in [o.name for o in tm.eval_model.graph.output]
    session = tm.session()
    target = np.eye(3, dtype=np.float32)
    for _ in range(3):
        session.step({"X": FEATURES}, target)
    path = tm.export_inference(tmp_path / "trained.onnx", session.state)
    label, probabilities = onnxruntime.InferenceSession(str(path)).run(["label", "probabilities"], {"X": FEATURES})
    trained = session.state
    hidden = np.maximum(FEATURES @ trained["coefficient"] + trained["intercepts"], 0)
    logits = hidden @ trained["coefficient1"] + trained["intercepts1"]
    want = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probabilities, want / want.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(label, np.argmax(probabilities, 1))  # classes 0, 1, 2


@pytest.mark.parametrize("options", [{"output": "label"}, {"output": "probabilities", "extra_outputs": True}])
def test_an_output_the_step_returns_still_needs_its_ops(options):
    with pytest.raises(UnsupportedOpError, match="ArrayFeatureExtractor"):
        bridge.to_training_onnx(str(SKLEARN_MLP), loss="mse", **options)
