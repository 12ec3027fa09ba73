"""Render the loss and optimizer tables of docs/losses_and_optimizers.md.

The ONNX ops in each row are read from a converted tiny model (Linear -> Tanh -> Linear,
logits [4, 3]), never written by hand: the loss's forward and backward nodes (phase "loss",
and phase "backward" of layer "loss"), the optimizer-phase nodes of the update, and the gradient clipping nodes.
Run: ``.venv/bin/python docs/op_tables.py`` rewrites the block between the markers (tests check it).
"""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

import bridge
from bridge.pipeline.optimizers import make_optimizer

BEGIN, END = "<!-- op tables: begin -->", "<!-- op tables: end -->"

LOSS_ROWS = [  # (loss, options, model output)
    ("mse", {}, "logits"),
    ("ce", {}, "logits"),
    ("ce", {"label_smoothing": 0.1, "weight": [1.0, 2.0, 3.0], "ignore_index": 0}, "logits"),
    ("ce", {"label_format": "probabilities"}, "logits"),
    ("bce_with_logits", {"pos_weight": [1.0, 2.0, 3.0]}, "logits"),
    ("bce", {}, "probs"),
    ("l1", {}, "logits"),
    ("smooth_l1", {"beta": 0.5}, "logits"),
    ("huber", {"delta": 0.5}, "logits"),
    ("nll", {}, "logprobs"),
    ("kl_div", {"reduction": "batchmean"}, "logprobs"),
]
LOSS_OPTIONS = {
    "mse": "reduction", "ce": "reduction, weight, ignore_index, label_smoothing, label_format",
    "bce_with_logits": "reduction, weight, pos_weight", "bce": "reduction, weight", "l1": "reduction",
    "smooth_l1": "reduction, beta", "huber": "reduction, delta", "nll": "reduction, weight, ignore_index",
    "kl_div": "reduction (mean, sum, batchmean), log_target",
}
OPTIMIZER_ROWS = [
    ("sgd", {}), ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "maximize": True}),
    ("adam", {}), ("adam", {"amsgrad": True, "weight_decay": 0.01}),
    ("adamw", {}), ("adagrad", {}), ("adagrad", {"lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("rmsprop", {}), ("rmsprop", {"centered": True, "momentum": 0.9}),
    ("adadelta", {}), ("adamax", {}), ("nadam", {}), ("nadam", {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("radam", {}), ("radam", {"decoupled_weight_decay": True, "weight_decay": 0.01}),
]


def _model(folder: Path, final: str) -> str:
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(5, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            y = self.fc2(torch.tanh(self.fc1(x)))
            return {"logits": y, "probs": torch.sigmoid(y), "logprobs": torch.log_softmax(y, -1)}[final]

    path = folder / f"{final}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Head(), (torch.randn(4, 5),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return str(path)


def _ops(tm: bridge.TrainingModel, keep) -> str:
    ops = set()
    for node in tm.model.graph.node:
        tags = {p.key: p.value for p in node.metadata_props}
        if keep(tags):
            ops.add(node.op_type)
    return ", ".join(sorted(ops))


def _options(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def tables() -> str:
    lines = [BEGIN, "", "| loss | torch | options | row converted with | ONNX ops (forward + backward of the loss) |",
             "| --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        models = {final: _model(Path(tmp), final) for final in ("logits", "probs", "logprobs")}
        for name, options, final in LOSS_ROWS:
            tm = bridge.to_training_onnx(models[final], loss=name, loss_options=options)
            ops = _ops(tm, lambda t: t.get("bridge.phase") == "loss" or (
                t.get("bridge.phase") == "backward" and t.get("bridge.layer") == "loss"))
            torch_name = bridge.pipeline.losses._LOSSES[name].signature.__name__
            lines.append(f"| `{name}` | F.{torch_name} | {LOSS_OPTIONS[name]} | {_options(options)} | {ops} |")
        lines += ["", "| optimizer | torch.optim | row converted with | state slots (`<weight>.<slot>`) | ONNX ops (update of one weight) |",
                  "| --- | --- | --- | --- | --- |"]
        for name, options in OPTIMIZER_ROWS:
            tm = bridge.to_training_onnx(models["logits"], loss="mse", optim=name, optim_options=options)
            optimizer = make_optimizer(name, options)
            ops = _ops(tm, lambda t: t.get("bridge.phase") == "optimizer" and t.get("bridge.layer") == "fc1.weight")
            slots = ", ".join(optimizer.slots()) or "none"
            lines.append(f"| `{name}` | {optimizer.rule.torch_class.__name__} | {_options(options)} | {slots} | {ops} |")
        tm = bridge.to_training_onnx(models["logits"], loss="mse", clip_grad_norm=1.0)
        ops = _ops(tm, lambda t: t.get("bridge.kind") == "clip_grad_norm")
        lines += ["", f"`clip_grad_norm=` (global L2 norm, before the update of every weight): {ops}"]
    return "\n".join(lines + ["", END])


if __name__ == "__main__":
    from blocks import write_block

    write_block(Path(__file__).with_name("losses_and_optimizers.md"), BEGIN, END, tables())
