"""Walk a converted CNN's training graph with ``bridge.ir`` (see docs/ir.md).

Prints each phase's ops, follows one weight to its gradient and to its update, and lists
the backward nodes of one forward layer. Run: ``.venv/bin/python examples/traverse_ir.py``.
"""
from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

import bridge


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.pool = torch.nn.MaxPool2d(2)
        self.conv2 = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, image):
        x = self.pool(torch.relu(self.bn1(self.conv1(image))))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc(x.flatten(1))


def export_cnn(path: Path) -> Path:
    torch.manual_seed(0)
    torch.onnx.export(
        SmallCNN().train(), (torch.randn(2, 1, 16, 16),), str(path), dynamo=False,
        input_names=["image"], output_names=["logits"],
        training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
    )
    return path


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    source = export_cnn(out_dir / "cnn.onnx")
    train = bridge.to_training_onnx(source, loss="ce", optim="adam", output_path=out_dir / "cnn_train.onnx")
    graph = bridge.ir.load(out_dir / "cnn_train.onnx")

    print("== ops per phase")
    for phase in ("forward", "loss", "backward", "optimizer"):
        ops = Counter(node.op_type for node in graph.nodes(phase))
        print(f"{phase:>10}: {sum(ops.values()):4d} nodes  {dict(ops.most_common(6))}")

    weight = "conv2.weight"
    print(f"\n== {weight}: forward use -> gradient -> update")
    for node in graph.consumers(weight):
        print(f"  read by   {node.name}  ({node.phase})")
    gradient = graph.gradients[weight]
    print(f"  gradient  {gradient} <- {graph.producer(gradient).name}")
    for node in graph.consumers(gradient):
        print(f"  used by   {node.name}  ({node.phase}, layer {node.layer})")
    print(f"  state     {graph.state_of(weight)}")
    updated = graph.updates[weight]
    print(f"  update    {updated} <- {graph.producer(updated).name}")

    layer = graph.producer(gradient).layer
    print(f"\n== backward nodes of forward layer '{layer}'")
    for node in graph.backward_of(layer):
        print(f"  {node.op_type:<10} {', '.join(node.inputs)} -> {', '.join(node.outputs)}")

    print("\n== activations and the gradients flowing back into them")
    for value in graph.activations:
        if graph.role(f"grad_{value}") == "gradient":
            print(f"  {value:<32} grad_{value}")
    print(f"\nonnx-mlir violations: {len(bridge.check(train.model))}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
