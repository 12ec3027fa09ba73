# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Walking the training IR
#
# bridge writes one ONNX graph for a whole training step. Every input and output carries a role,
# every node a phase (`forward`, `loss`, `backward`, `optimizer`), the source layer it computes or
# differentiates, and a kind (docs/ir.md). `bridge.ir` reads those labels back. Here we walk a
# small CNN's graph: its inputs by role, the nodes per phase, one backward Conv and where the
# gradient it makes goes, and the Adam update of that weight.

# %%
import copy
import io
import warnings
from collections import Counter

import matplotlib.pyplot as plt
import numpy as np
import onnx
import torch

import bridge

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
)
buffer = io.BytesIO()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
    torch.onnx.export(model.train(), (torch.zeros(2, 1, 16, 16),), buffer, dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      input_names=["image"], output_names=["logits"])
# target="plain": the canonical graph (the default, target="onnxruntime", writes some backward Convs
# as matrix products, which onnxruntime runs faster; docs/ARCHITECTURE.md)
tm = bridge.to_training_onnx(onnx.load_from_string(buffer.getvalue()), loss="ce", optim="adam", target="plain")
graph = bridge.ir.load(tm.model)

# %% [markdown]
# ## Inputs and outputs by role

# %%
for role in ("inputs", "targets", "weights", "buffers", "optimizer_state", "hyperparameters"):
    names = getattr(graph, role)
    print(f"{role:<16} {len(names):3d}  {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
print(f"{'loss':<16}      {graph.loss}")
print(f"{'gradients':<16} {len(graph.gradients):3d}  {', '.join(list(graph.gradients.values())[:3])} ...")
print(f"{'updates':<16} {len(graph.updates):3d}  {', '.join(list(graph.updates.values())[:3])} ...")

# %% [markdown]
# ## Nodes per phase
#
# The forward pass is the source model; the loss, the backward pass and the optimizer are
# plain ONNX ops that bridge wrote.

# %%
phases = ("forward", "loss", "backward", "optimizer")
counts = {phase: Counter(node.op_type for node in graph.nodes(phase)) for phase in phases}
for phase in phases:
    print(f"{phase:>10}: {sum(counts[phase].values()):4d} nodes  {dict(counts[phase].most_common(5))}")

ops = sorted({op for counter in counts.values() for op in counter}, key=lambda op: -sum(c[op] for c in counts.values()))[:12]
fig, ax = plt.subplots(figsize=(10, 3.5))
bottom = np.zeros(len(ops))
for phase in phases:
    heights = np.array([counts[phase][op] for op in ops])
    ax.bar(ops, heights, bottom=bottom, label=phase)
    bottom += heights
ax.set(ylabel="nodes", title="the 12 most used ops, by phase")
ax.tick_params(axis="x", rotation=45)
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## A backward Conv and where its gradient goes
#
# The second Conv's weight (`4.weight`: the module's index 4) is read by its forward Conv, by
# its backward (the gradient of the Conv's input needs the kernel) and by its Adam update. The
# backward layer's Convs make the gradients of the Conv's input and of its weight. The weight's
# gradient is a graph output (`grad_4.weight`) and is read by the Adam nodes of the optimizer
# phase, which write `updated_4.weight`.

# %%
weight = "4.weight"
for node in graph.consumers(weight):
    print(f"{weight} read by {node.name} ({node.phase})")
(forward,) = [node for node in graph.consumers(weight) if node.phase == "forward"]
print(f"forward   {forward.name}: {forward.op_type}({', '.join(forward.inputs)})")
layer = forward.layer
backward = graph.backward_of(layer)
print(f"backward of layer {layer!r}: {len(backward)} nodes, ops {dict(Counter(n.op_type for n in backward))}")
for node in backward:
    if node.op_type == "Conv":
        print(f"  Conv {', '.join(node.inputs)} -> {', '.join(node.outputs)}")
gradient = graph.gradients[weight]
producer = graph.producer(gradient)
print(f"gradient  {gradient} <- {producer.name} ({producer.phase})")
for node in graph.consumers(gradient):
    print(f"  read by {node.name} ({node.phase}, layer {node.layer}, kind {node.kind})")
print(f"state     {graph.state_of(weight)}")
updated = graph.updates[weight]
print(f"update    {updated} <- {graph.producer(updated).name}")
print(f"optimizer nodes for {weight}: {len(graph.update_of(weight))}")
assert producer.phase == "backward" and producer.layer == layer
assert all(node.phase == "optimizer" for node in graph.consumers(gradient))

# %% [markdown]
# ## The gradient is the one PyTorch computes
#
# One step in onnxruntime returns `grad_4.weight`; PyTorch's autograd on the same module, in
# float64, is the oracle (BatchNorm in training mode on both sides).

# %%
rng = np.random.default_rng(0)
image = rng.standard_normal((2, 1, 16, 16)).astype(np.float32)
label = rng.integers(0, 10, 2)
out = tm.session(threads=1).step({"image": image}, label)


def conv_weight_gradient(dtype: torch.dtype) -> np.ndarray:
    twin = copy.deepcopy(model).to(dtype).train()
    loss = torch.nn.functional.cross_entropy(twin(torch.tensor(image, dtype=dtype)), torch.tensor(label))
    loss.backward()
    return twin[4].weight.grad.double().numpy()


reference, torch32 = conv_weight_gradient(torch.float64), conv_weight_gradient(torch.float32)
error, noise = np.abs(out[gradient] - reference).max(), np.abs(torch32 - reference).max()
print(f"max |grad_4.weight - float64 torch| = {error:.1e}; torch float32's own: {noise:.1e} "
      f"(max |grad| {np.abs(reference).max():.4f})")
assert error <= 10 * max(noise, np.finfo(np.float32).eps * np.abs(reference).max())
