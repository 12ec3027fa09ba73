"""The whole lifecycle on scikit-learn's handwritten digits (8x8 images, 10 classes).

    python examples/digits.py [out_dir]

A small CNN (Conv -> BatchNorm -> ReLU -> Dropout -> Linear) is exported to ONNX by torch in
training mode, converted to a training graph, trained with bridge.Trainer (Adam, one-cycle lr,
dynamic batch), checkpointed, and written back as an inference model whose test accuracy is
printed. The same CNN (same initial weights) is trained side by side in torch with the same
optimizer, schedule and batch order; the loss and accuracy of both are printed each epoch and
drawn in ``<out_dir>/digits.png`` (if matplotlib is installed). Exits non-zero unless the test
accuracy is >= 95%, within 1 point of torch's, and the inference model's equals the eval graph's.
When onnx-mlir is installed (``ONNX_MLIR_HOME`` or ``PATH``), the same Trainer also runs on onnx-mlir
(``backend="onnx-mlir"``), whose test accuracy is printed beside onnxruntime's and must be within 1 point.
Needs scikit-learn (the test extra), only for the data.
"""
import copy
import io
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bridge


def digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Train and test splits: images [N, 1, 8, 8] scaled to [0, 1], labels [N]."""
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], data.target.astype(np.int64)[order]
    return (images[:1400], labels[:1400]), (images[1400:], labels[1400:])


EPOCHS, BATCH, MAX_LR, SEED = 4, 64, 0.01, 0


def cnn_module() -> torch.nn.Module:
    """The CNN, seeded: Conv -> BatchNorm -> ReLU -> Dropout -> Linear."""
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(8 * 8 * 8, 10))


def cnn_onnx(module: torch.nn.Module) -> onnx.ModelProto:
    """The inference model a user would have: exported in training mode with a symbolic batch."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module).train(), (torch.zeros(2, 1, 8, 8),), buffer, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["image"], output_names=["logits"],
                          dynamic_axes={"image": {0: "N"}, "logits": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def torch_twin(tm: bridge.TrainingModel) -> torch.nn.Module:
    """The same CNN in torch, starting from the training graph's initial weights and statistics."""
    module = cnn_module()
    state = tm.initial_state()
    names = set(module.state_dict()) - {name for name in module.state_dict() if name.endswith("num_batches_tracked")}
    missing = names - set(state)
    if missing:
        raise SystemExit(f"the torch twin has values the training graph lacks: {sorted(missing)}")
    module.load_state_dict({name: torch.from_numpy(state[name].copy()) for name in names}, strict=False)
    return module


def torch_fit(module: torch.nn.Module, train: tuple, test: tuple, steps: int) -> bridge.History:
    """torch's own loop with the Trainer's settings: Adam, OneCycleLR stepped per batch (momentum not
    cycled), the same shuffled order per epoch (numpy generator seeded as the Trainer's), eval each epoch."""
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=steps,
                                                    cycle_momentum=False)
    x, y = torch.from_numpy(train[0]), torch.from_numpy(train[1])
    rng, history = np.random.default_rng(SEED), bridge.History()
    for epoch in range(EPOCHS):
        module.train()
        order, total, correct = torch.from_numpy(rng.permutation(len(y))), 0.0, 0
        for start in range(0, len(y), BATCH):
            index = order[start:start + BATCH]
            logits = module(x[index])
            loss = F.cross_entropy(logits, y[index])
            history.steps.append({"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]})
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.item() * len(index)
            correct += int((logits.argmax(1) == y[index]).sum())
        val_loss, val_accuracy = torch_evaluate(module, test)
        history.epochs.append({"epoch": epoch + 1, "loss": total / len(y), "accuracy": correct / len(y),
                               "val_loss": val_loss, "val_accuracy": val_accuracy})
    return history


def torch_evaluate(module: torch.nn.Module, data: tuple) -> tuple[float, float]:
    """torch ``model.eval()`` on ``data``: the loss and the accuracy."""
    module.eval()
    with torch.no_grad():
        logits = module(torch.from_numpy(data[0]))
        loss = F.cross_entropy(logits, torch.from_numpy(data[1])).item()
    return loss, float(np.mean(logits.argmax(1).numpy() == data[1]))


def main(out: Path) -> None:
    (train_x, train_y), (test_x, test_y) = digits()
    tm = bridge.to_training_onnx(cnn_onnx(cnn_module()), loss="ce", optim="adam", optim_options={"lr": 1e-3},
                                 extra_outputs=True)
    tm.save(out / "digits.train.onnx")
    steps = EPOCHS * -(-len(train_y) // BATCH)
    options = {"schedule": "onecycle", "schedule_options": {"max_lr": MAX_LR, "total_steps": steps}, "seed": SEED}
    trainer = bridge.Trainer(tm, **options)
    start = time.perf_counter()
    history = trainer.fit((train_x, train_y), epochs=EPOCHS, batch_size=BATCH, validation=(test_x, test_y))
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    reference = torch_fit(torch_twin(tm), (train_x, train_y), (test_x, test_y), steps)
    torch_seconds = time.perf_counter() - start
    for mine, theirs in zip(history.epochs, reference.epochs, strict=True):
        print(f"epoch {mine['epoch']}  bridge: loss {mine['loss']:.4f}  accuracy {mine['accuracy']:.3f}  "
              f"val_loss {mine['val_loss']:.4f}  val_accuracy {mine['val_accuracy']:.3f}   |   torch: loss "
              f"{theirs['loss']:.4f}  accuracy {theirs['accuracy']:.3f}  val_loss {theirs['val_loss']:.4f}  "
              f"val_accuracy {theirs['val_accuracy']:.3f}")
    accuracy, torch_accuracy = history["val_accuracy"][-1], reference["val_accuracy"][-1]
    print(f"test accuracy: bridge {accuracy:.3f} ({seconds:.1f} s in onnxruntime), torch {torch_accuracy:.3f} "
          f"({torch_seconds:.1f} s), difference {100 * abs(accuracy - torch_accuracy):.1f} points")
    compiled_accuracy = onnx_mlir_accuracy(tm, options, (train_x, train_y), (test_x, test_y), accuracy)
    trainer.save_checkpoint(out / "digits.ckpt.npz")
    path = trainer.export_inference(out / "digits.trained.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"image": test_x})
    exported = float(np.mean(logits.argmax(1) == test_y))
    print(f"inference model {path}: test accuracy {exported:.3f} (eval graph {accuracy:.3f})")
    plot(out / "digits.png", history, reference)
    if accuracy < 0.95 or abs(accuracy - torch_accuracy) > 0.01 or exported != accuracy:
        raise SystemExit("FAILED: expected test accuracy >= 0.95, within 1 point of torch, and the inference "
                         "model's equal to the eval graph's")
    if compiled_accuracy is not None and abs(compiled_accuracy - accuracy) > 0.01:
        raise SystemExit("FAILED: expected onnx-mlir's test accuracy within 1 point of onnxruntime's")


def onnx_mlir_accuracy(tm: bridge.TrainingModel, options: dict, train: tuple, test: tuple, ort_accuracy: float) -> float | None:
    """The same training on onnx-mlir (compiled by bridge.compile); its test accuracy, None without onnx-mlir."""
    from bridge.training.runtime_onnx_mlir import OnnxMlirNotFoundError

    start = time.perf_counter()
    try:
        trainer = bridge.Trainer(tm, backend="onnx-mlir", **options)
    except OnnxMlirNotFoundError as exc:
        print(f"onnx-mlir: not run ({exc})")
        return None
    compiled = time.perf_counter() - start
    history = trainer.fit(train, epochs=EPOCHS, batch_size=BATCH, validation=test)
    accuracy = history["val_accuracy"][-1]
    print(f"onnx-mlir: test accuracy {accuracy:.3f} (compiled in {compiled:.1f} s, trained in "
          f"{time.perf_counter() - start - compiled:.1f} s), onnxruntime {ort_accuracy:.3f}")
    return accuracy


def plot(path: Path, history: bridge.History, reference: bridge.History) -> None:
    """The bridge and torch curves overlaid (skipped when matplotlib is not installed)."""
    from bridge.training.plot import MissingDependencyError, plot_history

    try:
        print(f"wrote {plot_history({'bridge': history, 'torch': reference}, path, title='digits: bridge vs torch')}")
    except MissingDependencyError as exc:
        print(f"no plot: {exc}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out"))
