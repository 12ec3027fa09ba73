"""Write tests/data/skl2onnx_mlp_classifier.onnx: a scikit-learn MLPClassifier (iris, 8 hidden
units) converted by skl2onnx as a user ships it: a ``label`` output through ArgMax and the
ai.onnx.ml ArrayFeatureExtractor, and a ``probabilities`` output through ZipMap (a sequence of
maps) unless ``zipmap=False``. The committed file is made with ``zipmap=False`` (a tensor of
probabilities, what a loss can use). Run in a side venv with skl2onnx and scikit-learn:
``python tests/data/make_skl2onnx_mlp.py``."""
from pathlib import Path

from skl2onnx import to_onnx
from sklearn.datasets import load_iris
from sklearn.neural_network import MLPClassifier

features, labels = load_iris(return_X_y=True)
features = features.astype("float32")
classifier = MLPClassifier(hidden_layer_sizes=(8,), max_iter=300, random_state=0).fit(features, labels)
model = to_onnx(classifier, features[:1], options={"zipmap": False}, target_opset={"": 18, "ai.onnx.ml": 3})
Path(__file__).with_name("skl2onnx_mlp_classifier.onnx").write_bytes(model.SerializeToString())
