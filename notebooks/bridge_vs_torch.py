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
# # bridge vs PyTorch, step by step
#
# A small CNN is exported from PyTorch to ONNX, converted by bridge into one training-step graph
# (forward, cross-entropy, backward, Adam) and trained in onnxruntime. The same module is trained
# by `torch.optim.Adam` on the same batches. We compare:
#
# 1. the first step's gradients, layer by layer, against a float64 PyTorch oracle, next to
#    PyTorch's own float32 error (the noise any float32 implementation has);
# 2. the loss, the gradients and the weights over 30 steps.
#
# Regenerate with `make notebooks`; `tests/test_notebooks.py` checks the saved outputs are current.

# %%
import copy
import io
import warnings

import matplotlib.pyplot as plt
import numpy as np
import onnx
import torch
import torch.nn.functional as F

import bridge

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(), torch.nn.Linear(16, 4),
)
buffer = io.BytesIO()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
    torch.onnx.export(model, (torch.zeros(8, 3, 16, 16),), buffer, dynamo=False,
                      input_names=["images"], output_names=["logits"], dynamic_axes={"images": {0: "N"}})
source = onnx.load_from_string(buffer.getvalue())
tm = bridge.to_training_onnx(source, loss="ce", optim="adam", optim_options={"lr": 1e-2})
print("trainable weights:", tm.weights)

# %% [markdown]
# ## The first step's gradients against a float64 oracle
#
# bridge's graph returns `grad_<weight>` for every weight. The oracle is the same module in
# float64; "torch float32" is what PyTorch itself computes in float32. bridge's error should be
# of the same size as PyTorch's.

# %%
rng = np.random.default_rng(0)
colours = rng.standard_normal((4, 3, 1, 1)).astype(np.float32)  # one colour shift per class, under noise


def batch() -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 4, 8)
    return colours[labels] + rng.standard_normal((8, 3, 16, 16)).astype(np.float32), labels


batches = [batch() for _ in range(30)]


def torch_gradients(module: torch.nn.Module, images: np.ndarray, labels: np.ndarray, dtype: torch.dtype) -> dict:
    twin = copy.deepcopy(module).to(dtype)
    loss = F.cross_entropy(twin(torch.tensor(images, dtype=dtype)), torch.tensor(labels))
    loss.backward()
    return {name: p.grad.double().numpy() for name, p in twin.named_parameters()}


images, labels = batches[0]
names = [name for name, _ in model.named_parameters()]
assert names == tm.weights  # the ONNX initializers keep torch's parameter names
session = tm.session(threads=1, seed=0)
first = session.step({"images": images}, labels)
oracle = torch_gradients(model, images, labels, torch.float64)
torch32 = torch_gradients(model, images, labels, torch.float32)
print(f"{'weight':<10} {'max |grad|':>11} {'bridge - f64':>13} {'torch32 - f64':>14}")
for name in names:
    bridge_error = np.abs(first[f"grad_{name}"] - oracle[name]).max()
    torch_error = np.abs(torch32[name] - oracle[name]).max()
    scale = np.abs(oracle[name]).max()
    print(f"{name:<10} {scale:11.4f} {bridge_error:13.2e} {torch_error:14.2e}")
    assert bridge_error <= 10 * max(torch_error, np.finfo(np.float32).eps * scale), name

# %% [markdown]
# ## 30 steps side by side
#
# Both sides start from the same weights and see the same batches. After every step we record
# the two losses, the largest gradient difference per layer (relative to that gradient's
# largest entry) and the largest weight difference.

# %%
session = tm.session(threads=1, seed=0)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
rows, gradient_gaps = [], {name: [] for name in names}
for step, (images, labels) in enumerate(batches, start=1):
    out = session.step({"images": images}, labels)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(torch.tensor(images)), torch.tensor(labels))
    loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        grad = p.grad.numpy()
        gradient_gaps[name].append(np.abs(out[f"grad_{name}"] - grad).max() / np.abs(grad).max())
    weight_gap = max(float(np.abs(session.state[n] - p.detach().numpy()).max()) for n, p in model.named_parameters())
    rows.append((step, float(out["loss"]), loss.item(), weight_gap))

print(f"{'step':>4} {'bridge loss':>12} {'torch loss':>11} {'|loss diff|':>12} {'max |w diff|':>13}")
for step, ours, theirs, gap in rows[::5] + rows[-1:]:
    print(f"{step:4d} {ours:12.5f} {theirs:11.5f} {abs(ours - theirs):12.1e} {gap:13.1e}")
assert rows[-1][1] < rows[0][1], "the loss falls"
assert max(r[3] for r in rows) < 1e-4, "the weights follow torch.optim step for step"

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
steps = [r[0] for r in rows]
left.plot(steps, [r[1] for r in rows], "o-", label="bridge (onnxruntime)")
left.plot(steps, [r[2] for r in rows], "x--", label="torch.optim")
left.set(xlabel="step", ylabel="cross-entropy", title="loss")
left.legend()
for name in names:
    right.semilogy(steps, np.maximum(gradient_gaps[name], 1e-10), label=name)
right.axhline(np.finfo(np.float32).eps, color="gray", linestyle=":", label="float32 eps")
right.set(xlabel="step", ylabel="max |grad diff| / max |grad|", title="gradient difference per layer")
right.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# The losses agree to float32 precision at every step; each layer's gradient stays within 1e-5 of
# its size of PyTorch's (a bias gradient sums over every pixel of the batch, in another order than
# PyTorch's: a few tens of float32 epsilons), and the weights stay within float32 noise of
# `torch.optim`'s: the training graph computes the PyTorch training step, in standard ONNX ops.
