"""Graph size: the training step's nodes per phase and op type, bridge's targets beside onnxsim's Adam step.

    python benchmarks/graph_size.py --models mlp resnet18 --targets onnxruntime onnx-mlir \\
        [--onnxsim-python <venv with onnxsim>/bin/python] [--ops | --kinds] [--batch-norm frozen]

Per model of benchmarks/models.py: bridge converts the legacy export (loss ``ce``, Adam; ``--batch-norm frozen``:
BatchNorm with its running statistics, as onnxsim trains it) for each target and its nodes are counted by their
``bridge.phase``. With ``--onnxsim-python``, the module with its loss appended
(``with_loss``: softmax cross-entropy of a one-hot target, in ops onnxsim differentiates) is built into onnxsim's
step graph by benchmarks/onnxsim_child.py in that venv. Prints a markdown table of nodes per phase (``--ops``:
and per phase and op type; ``--kinds``: and per phase and bridge's ``bridge.kind`` tag, the ATen op or layer kind
a node was emitted for, which onnxsim's nodes do not carry).
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from models import MODELS, BenchModel  # noqa: E402

PHASES = ("forward", "loss", "backward", "optimizer")
Counts = dict[str, dict[str, int]]  # phase -> op type (or kind) -> nodes
UNTAGGED = "(untagged)"  # the kind row of a column whose nodes carry no bridge.kind (onnxsim's)


def bridge_counts(model: onnx.ModelProto, by: str = "op") -> Counts:
    """Nodes of a bridge training graph per phase (``bridge.phase``) and op type (``by="kind"``: ``bridge.kind``)."""
    counts: Counts = collections.defaultdict(dict)
    for node in model.graph.node:
        tags = {p.key: p.value for p in node.metadata_props}
        key = node.op_type if by == "op" else tags.get("bridge.kind", UNTAGGED)
        phase = tags.get("bridge.phase", "?")
        counts[phase][key] = counts[phase].get(key, 0) + 1
    return counts


class _WithLoss(torch.nn.Module):
    """The module, then the mean cross-entropy of its logits against a one-hot target (``F.cross_entropy``)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        *inputs, onehot = args
        logits = self.module(*inputs)
        if logits.dim() > 2:  # [N, T, V]: classes on the last dim, as bridge's ce
            logits = logits.flatten(0, -2)
        return -(onehot * torch.log(torch.softmax(logits, 1))).sum(1).mean()


def with_loss(bench: BenchModel, path: Path) -> Path:
    """``bench``'s module with its loss as one ONNX model (output ``loss``, inputs the model's and ``onehot``),
    its Constant nodes as initializers and Flatten as Reshape (onnxsim differentiates neither)."""
    inputs = [torch.from_numpy(v) for v in bench.inputs.values()]
    bench.module.eval()
    with torch.no_grad():
        classes = bench.module(*inputs).shape[-1]
    onehot = F.one_hot(torch.from_numpy(bench.target).reshape(-1), classes).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_WithLoss(bench.module), (*inputs, onehot), str(path), dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=[*bench.inputs, "onehot"], output_names=["loss"])
    bench.module.train()
    model = onnx.load(str(path))
    nodes = []
    for node in model.graph.node:
        if node.op_type == "Constant":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            continue
        if node.op_type == "Flatten":  # Flatten(axis=1) of [N, ...] is Reshape to [N, -1]
            shape = f"{node.output[0]}/shape"
            model.graph.initializer.append(numpy_helper.from_array(np.array([0, -1], np.int64), shape))
            node = helper.make_node("Reshape", [node.input[0], shape], list(node.output), name=node.name)
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(path))
    return path


def onnxsim_counts(python: str, source: Path) -> Counts:
    """onnxsim's step graph of ``source`` (a model ending in ``loss``), counted in a child of ``python``."""
    done = subprocess.run([python, str(HERE / "onnxsim_child.py"), str(source)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"onnxsim's step of {source.name} did not build: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(name: str, targets: Sequence[str], onnxsim_python: str | None, workdir: Path,
            by: str = "op", batch_norm: str = "train") -> dict[str, Counts]:
    """Node counts of ``name``'s step per column: ``bridge <target>`` for each target, ``onnxsim`` when asked;
    per phase and op type, or (``by="kind"``) per phase and ``bridge.kind``, onnxsim's as one untagged row."""
    import bridge

    bench = MODELS[name]()
    source = bench.export(workdir / f"{name}.onnx")
    columns = {}
    for target in targets:
        model = bridge.to_training_onnx(str(source), loss="ce", optim="adam", target=target,
                                        batch_norm=batch_norm).model
        columns[f"bridge {target}"] = bridge_counts(model, by)
    if onnxsim_python is not None:
        counts = onnxsim_counts(onnxsim_python, with_loss(bench, workdir / f"{name}.loss.onnx"))
        columns["onnxsim"] = counts if by == "op" else {p: {UNTAGGED: sum(ops.values())} for p, ops in counts.items()}
    return columns


def markdown(name: str, columns: dict[str, Counts], ops: bool, label: str = "op") -> list[str]:
    """The table of one model: nodes per phase and in all (``ops``: a row per phase and ``label``, op type or kind)."""
    header = ["| phase | " + (f"{label} | " if ops else "") + " | ".join(columns) + " |",
              "|---" * (len(columns) + 1 + ops) + "|"]
    rows = []
    for phase in PHASES:
        if ops:
            names = sorted({op for counts in columns.values() for op in counts.get(phase, {})})
            rows += [f"| {phase} | {op} | " + " | ".join(str(c.get(phase, {}).get(op, 0)) for c in columns.values())
                     + " |" for op in names]
        rows.append(f"| {phase} | " + ("all | " if ops else "")
                    + " | ".join(str(sum(c.get(phase, {}).values())) for c in columns.values()) + " |")
    total = " | ".join(str(sum(sum(ops_.values()) for ops_ in c.values())) for c in columns.values())
    return [f"### {name}", "", *header, *rows, f"| total | {'| ' if ops else ''}{total} |", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=sorted(MODELS))
    parser.add_argument("--targets", nargs="+", default=["onnxruntime", "onnx-mlir"])
    parser.add_argument("--onnxsim-python", help="the python of a venv with onnxsim")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--ops", action="store_true", help="a row per phase and op type")
    rows.add_argument("--kinds", action="store_true", help="a row per phase and bridge.kind (what a node was emitted for)")
    parser.add_argument("--batch-norm", default="train", choices=["train", "frozen"],
                        help="bridge's to_training_onnx(batch_norm=); frozen: BatchNorm as onnxsim trains it")
    args = parser.parse_args(argv)
    by = "kind" if args.kinds else "op"
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models:
            columns = measure(name, args.targets, args.onnxsim_python, Path(workdir), by, args.batch_norm)
            print("\n".join(markdown(name, columns, args.ops or args.kinds, by)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
