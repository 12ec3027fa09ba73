"""Run by benchmarks/graph_size.py in a venv with onnxsim: onnxsim's Adam step graph of a model that ends in its loss,
its nodes counted per phase and op type, printed as one JSON line.

    <onnxsim venv>/bin/python benchmarks/onnxsim_child.py model_with_loss.onnx

onnxsim tags no phase, so the phase comes from the graph: the source model's nodes are the forward (``/module/...``)
and the loss (the rest of the source), a node reading the optimizer's state, its hyper-parameters or a node already
in the optimizer is the optimizer (so is the squared gradient only the update reads), every other node the backward.
Standard library, numpy and onnx only, so that graph_size.py's venv can import ``phases``.
"""
from __future__ import annotations

import collections
import json
import sys

import onnx

_OPTIMIZER_INPUTS = ("trainstep__m_", "trainstep__v_", "trainstep__beta", "trainstep__one_minus_beta", "trainstep__eps")
_OPTIMIZER_SCALARS = {"lr", "m_correction", "v_correction"}


def phases(graph: onnx.GraphProto) -> list[tuple[str, str]]:
    """(phase, op type) of every node of onnxsim's step graph, in graph order."""
    names = {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer}
    optimizer = {name for name in names if name.startswith(_OPTIMIZER_INPUTS)} | _OPTIMIZER_SCALARS
    readers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    squares = {node.output[0] for node in graph.node if node.op_type == "Mul" and node.input[0] == node.input[1]
               and readers[node.output[0]] and all(set(r.input) & optimizer for r in readers[node.output[0]])}
    result = []
    for node in graph.node:
        if node.name.startswith("/module/"):
            phase = "forward"
        elif node.name.startswith("/"):
            phase = "loss"
        elif set(node.input) & optimizer or node.output[0] in squares:
            phase = "optimizer"
            optimizer.update(node.output)
        else:
            phase = "backward"
        result.append((phase, node.op_type))
    return result


def main(path: str) -> None:
    from onnxsim import compile_training

    model = onnx.load(path)
    params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims
              and "running_" not in t.name]
    step = compile_training.compile_training_loop(model, "loss", params, optimizer="adam").step_graph.model
    counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (phase, op), count in collections.Counter(phases(step.graph)).items():
        counts[phase][op] = count
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1])
