# ---
# jupyter:
#   bridge_requires:
#   - iree
#   - onnx-mlir
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # One training graph, three runtimes: onnxruntime, IREE, onnx-mlir
#
# bridge's training step is standard ONNX, so compilers that take ONNX compile it like any model.
# We convert the bundled MLP once (`target="plain"`: the canonical form every runtime takes),
# step it in onnxruntime, then compile it with IREE and with onnx-mlir (`bridge.compile`, through
# `tm.session(backend=...)`) and run the same 20 steps, same batches, on each. A runtime that is not
# installed is reported and skipped (IREE: the `bridge[iree]` extra; onnx-mlir: `ONNX_MLIR_HOME`,
# docs/onnx-mlir.md).

# %%
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import bridge
from bridge.tools.target_check import onnx_mlir_missing

MLP = Path(bridge.__file__).resolve().parents[1] / "examples" / "models" / "mlp.onnx"
tm = bridge.to_training_onnx(MLP, loss="ce", optim="adam", optim_options={"lr": 0.01}, batch_size=32, target="plain")
rng = np.random.default_rng(0)
batches = [(rng.standard_normal((32, 8)).astype(np.float32), rng.integers(0, 3, 32)) for _ in range(20)]
print("trainable weights:", tm.weights)

# %%
def iree_missing() -> str | None:
    try:
        import iree.compiler  # noqa: F401
        import iree.runtime  # noqa: F401
    except ImportError:
        return "IREE is not installed (pip install 'bridge[iree]')"
    return None


missing = {"onnxruntime": None, "iree": iree_missing(), "onnx-mlir": onnx_mlir_missing()}
runs = {}
for backend, why_not in missing.items():
    if why_not is not None:
        print(f"{backend}: skipped ({why_not.splitlines()[0]})")
        continue
    start = time.perf_counter()
    session = tm.session(threads=1, seed=0) if backend == "onnxruntime" else tm.session(backend=backend, seed=0)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    losses = [float(session.step({"features": x}, y)["loss"]) for x, y in batches]
    stepped = time.perf_counter() - start
    runs[backend] = (losses, {name: np.array(session.state[name]) for name in tm.weights})
    print(f"{backend}: 20 steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"timing: {backend} session/compile {compiled:.1f} s, 20 steps {1000 * stepped:.1f} ms")

# %% [markdown]
# ## Do the runtimes agree?
#
# Each compiled runtime against onnxruntime: the largest loss difference over the 20 steps and
# the largest weight difference at the end. Compilers reorder float32 sums, so differences of a
# few units in the last place are expected (the cell asserts at most 16); the curves lie on top of
# each other.

# %%
reference_losses, reference_weights = runs["onnxruntime"]
print(f"{'runtime':<10} {'max |loss diff|':>16} {'max |weight diff|':>18}")
for backend, (losses, weights) in runs.items():
    loss_gap = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
    weight_gap = max(float(np.abs(weights[n] - reference_weights[n]).max()) for n in tm.weights)
    print(f"{backend:<10} {loss_gap:16.1e} {weight_gap:18.1e}")
    # float32 noise: a few units in the last place of the loss and of the largest weight
    ulp = np.finfo(np.float32).eps
    largest_weight = max(float(np.abs(w).max()) for w in reference_weights.values())
    assert loss_gap <= 16 * ulp * max(reference_losses) and weight_gap <= 16 * ulp * largest_weight, backend

fig, ax = plt.subplots(figsize=(7, 3.5))
for (backend, (losses, _)), marker in zip(runs.items(), "o^s", strict=False):
    ax.plot(range(1, 21), losses, marker=marker, fillstyle="none", label=backend)
ax.set(xlabel="step", ylabel="cross-entropy", title="the same training graph in each runtime")
ax.legend()
fig.tight_layout()
plt.show()
