"""The whole lifecycle on scikit-learn's handwritten digits (8x8 images, 10 classes).

    python examples/digits.py [out_dir]

A small CNN (Conv -> BatchNorm -> ReLU -> Dropout -> Linear) is exported to ONNX by torch in
training mode, converted to a training graph, trained with bridge.Trainer (Adam, one-cycle lr,
dynamic batch), checkpointed, and written back as an inference model whose test accuracy is
printed. Needs scikit-learn (the test extra), only for the data.
"""
import io
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from sklearn.datasets import load_digits

import bridge


def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and test splits: images [N, 1, 8, 8] scaled to [0, 1], labels [N]."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], data.target.astype(np.int64)[order]
    return (images[:1400], labels[:1400]), (images[1400:], labels[1400:])


def cnn_onnx() -> onnx.ModelProto:
    """The inference model a user would have: exported with a symbolic batch."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(8 * 8 * 8, 10))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), (torch.zeros(2, 1, 8, 8),), buffer, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["image"], output_names=["logits"],
                          dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def main(out: Path) -> None:
    (train_x, train_y), (test_x, test_y) = digits()
    tm = bridge.to_training_onnx(cnn_onnx(), loss="ce", optim="adam", optim_options={"lr": 1e-3},
                                 extra_outputs=True)
    tm.save(out / "digits.train.onnx")
    epochs, batch_size = 4, 64
    steps = epochs * -(-len(train_y) // batch_size)
    trainer = bridge.Trainer(tm, schedule="onecycle", schedule_options={"max_lr": 0.01, "total_steps": steps})
    history = trainer.fit((train_x, train_y), epochs=epochs, batch_size=batch_size, validation=(test_x, test_y))
    for record in history.epochs:
        print(f"epoch {record['epoch']}  loss {record['loss']:.4f}  accuracy {record['accuracy']:.3f}  "
              f"val_loss {record['val_loss']:.4f}  val_accuracy {record['val_accuracy']:.3f}")
    trainer.save_checkpoint(out / "digits.ckpt.npz")
    path = trainer.export_inference(out / "digits.trained.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": test_x})
    print(f"inference model {path}: test accuracy {np.mean(logits.argmax(1) == test_y):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out"))
