"""The main job on the bundled example: convert, then train in onnxruntime.

    python examples/demo.py [model.onnx]

Converts the model to a training-step graph (cross-entropy + RMSprop), saves it to
``out/train.onnx``, and runs training steps on a synthetic 3-class problem, printing the
loss as it falls.
"""
import sys
from pathlib import Path

import numpy as np

import bridge

HERE = Path(__file__).parent


def synthetic_batch(rng: np.random.Generator, batch: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Three Gaussian blobs in 8-D: the class is which centre a point comes from."""
    centres = np.eye(3, 8, dtype=np.float32) * 3.0
    labels = rng.integers(0, 3, size=batch)
    features = centres[labels] + rng.standard_normal((batch, 8)).astype(np.float32)
    return features.astype(np.float32), labels.astype(np.int64)


def main(model_path: str) -> None:
    out = Path("out")
    tm = bridge.to_training_onnx(model_path, loss="ce", optim="rmsprop", optim_options={"lr": 0.003}, batch_size=32)
    path = tm.save(out / "train.onnx")
    ops = {}
    for node in tm.model.graph.node:
        phase = next((p.value for p in node.metadata_props if p.key == "bridge.phase"), "?")
        ops[phase] = ops.get(phase, 0) + 1
    print(f"training graph: {path} ({len(tm.model.graph.node)} nodes: {ops})")
    print(f"trainable weights: {tm.weights}")

    session = tm.session()
    rng = np.random.default_rng(0)
    losses = []
    for step in range(1, 61):
        features, labels = synthetic_batch(rng)
        losses.append(float(session.step({"features": features}, labels)["loss"]))
        if step % 10 == 0:
            print(f"steps {step - 9:2d}-{step:2d}  mean loss {np.mean(losses[-10:]):.4f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE / "models" / "mlp.onnx"))
