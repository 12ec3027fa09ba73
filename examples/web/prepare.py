"""Write what the browser page and node_step.mjs train: the digits CNN as a bridge training graph.

    python examples/web/prepare.py [out_dir]       # default: examples/web/build
    python examples/web/prepare.py --evaluate weights.json [out_dir]

Writes ``train.onnx`` (the step), ``train.eval.onnx`` (the eval graph), ``state.bin`` (the initial
state: float32 arrays concatenated in ``manifest.json``'s order), ``digits.bin`` (sklearn's digits:
float32 images of the train then test split, then int32 labels) and ``manifest.json`` (names,
shapes, offsets). The CNN has no Dropout, so a step has no noise input and any runtime given the
same batches computes the same step. ``--evaluate`` loads weights downloaded from the page
(``weights.json``: {name: {"shape", "data"}}) and prints the eval graph's test accuracy.
"""
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
from digits import cnn_onnx, digits  # noqa: E402

import bridge  # noqa: E402

BATCH, LR = 64, 0.01


def cnn_module() -> torch.nn.Module:
    """The digits CNN without Dropout (no noise input): Conv -> BatchNorm -> ReLU -> Linear."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))


def prepare(out: Path) -> dict:
    """Convert the CNN and write the graphs, initial state, data and manifest into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tm = bridge.to_training_onnx(cnn_onnx(cnn_module()), loss="ce", optim="adam", optim_options={"lr": LR})
    if tm.signature.random:
        raise SystemExit(f"the model has noise inputs {list(tm.signature.random)}; this example needs none")
    tm.save(out / "train.onnx")
    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in tm.model.graph.input}
    state, entries, offset = tm.initial_state(), [], 0
    with open(out / "state.bin", "wb") as f:
        for name, value in state.items():
            value = np.ascontiguousarray(value, dtype=np.float32).reshape(declared.get(name, np.shape(value)))
            f.write(value.tobytes())
            entries.append({"name": name, "shape": list(value.shape), "offset": offset})
            offset += value.size
    (train_x, train_y), (test_x, test_y) = digits()
    with open(out / "digits.bin", "wb") as f:
        for array in (train_x, test_x):
            f.write(array.astype(np.float32).tobytes())
        for array in (train_y, test_y):
            f.write(array.astype(np.int32).tobytes())
    manifest = {"batch": BATCH, "state": entries, "weights": list(tm.signature.weights) + list(tm.signature.buffers),
                "input": tm.signature.inputs[0], "image_shape": list(train_x.shape[1:]),
                "train": len(train_y), "test": len(test_y)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """The weights and buffers the page downloads (``weights.json``) as float32 arrays."""
    raw = json.loads(Path(path).read_text())
    return {name: np.asarray(entry["data"], dtype=np.float32).reshape(entry["shape"]) for name, entry in raw.items()}


def evaluate(build: Path, weights: dict[str, np.ndarray]) -> float:
    """The eval graph's test accuracy with ``weights`` (in onnxruntime)."""
    (_, _), (test_x, test_y) = digits()
    session = ort.InferenceSession(str(build / "train.eval.onnx"), providers=["CPUExecutionProvider"])
    feed = {"target": test_y}
    for spec in session.get_inputs():
        if spec.name in weights:
            feed[spec.name] = weights[spec.name]
        elif spec.name != "target":
            feed[spec.name] = test_x
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feed), strict=True))
    logits = next(value for name, value in out.items() if name.startswith("output_"))
    return float(np.mean(logits.argmax(1) == test_y))


if __name__ == "__main__":
    args = sys.argv[1:]
    default = Path(__file__).resolve().parent / "build"
    if args and args[0] == "--evaluate":
        build = Path(args[2]) if len(args) > 2 else default
        print(f"test accuracy {evaluate(build, load_weights(args[1])):.4f}")
    else:
        print(json.dumps(prepare(Path(args[0]) if args else default)))
