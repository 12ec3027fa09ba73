"""The oracle: run the training graph in onnxruntime and the same steps in eager PyTorch.

``bridge_steps`` runs a converted model for several steps (state fed back). ``torch_steps``
runs the same steps with real ``torch.optim`` on a torch function of the weights, so every
comparison is against PyTorch itself, never against bridge's own code.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

import bridge
from bridge.tools.verify import scale_of

Batch = tuple[dict[str, np.ndarray], np.ndarray]


def bridge_steps(tm: bridge.TrainingModel, batches: Sequence[Batch], lr_schedule: Mapping[int, float] | None = None) -> list[dict]:
    """Run ``tm`` in onnxruntime; per step: loss, grad_<w>, updated weights and buffers."""
    session = tm.session()
    records = []
    for index, (inputs, target) in enumerate(batches):
        if lr_schedule and index in lr_schedule:
            session.lr = lr_schedule[index]
        out = session.step(inputs, target)
        records.append(out)
    return records


def torch_steps(
    forward: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
    weights: Mapping[str, np.ndarray],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: type[torch.optim.Optimizer],
    options: Mapping,
    batches: Sequence[Batch],
    lr_schedule: Mapping[int, float] | None = None,
    max_grad_norm: float | None = None,
) -> list[dict]:
    """The same steps in eager torch: ``forward(weights, inputs) -> output``, real torch.optim.

    With ``max_grad_norm``, ``torch.nn.utils.clip_grad_norm_`` runs before each optimizer step
    (the recorded gradients are the unclipped ones).
    """
    params = {name: torch.nn.Parameter(torch.tensor(np.array(value))) for name, value in weights.items()}
    opt = optimizer(list(params.values()), **options)
    records = []
    for index, (inputs, target) in enumerate(batches):
        if lr_schedule and index in lr_schedule:
            for group in opt.param_groups:
                group["lr"] = lr_schedule[index]
        opt.zero_grad()
        output = forward(params, {k: torch.tensor(v) for k, v in inputs.items()})
        loss = loss_fn(output, torch.tensor(target))
        loss.backward()
        record = {"loss": loss.detach().numpy()}
        record.update({f"grad_{n}": p.grad.detach().numpy().copy() for n, p in params.items()})
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm, foreach=False)
        opt.step()
        record.update({f"updated_{n}": p.detach().numpy().copy() for n, p in params.items()})
        records.append(record)
    return records


def assert_steps_match(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
    """Every key of ``want`` (loss, grads, updated weights) matches at every step.

    The tolerance is relative, per element and to the tensor's scale (``assert_close_to_scale``).
    """
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key, expected in w.items():
            assert key in g, f"step {step}: output {key} missing"
            assert_close_to_scale(g[key], expected, rtol, floor=1e-12, err_msg=f"step {step}: {key}")


def tolerance_to_scale(rtol: float, expected: np.ndarray, floor: float = 0.0) -> float:
    """The absolute error allowed on ``expected``: ``rtol`` of its scale (``scale_of``, verify's: float32
    noise in an element near zero is judged against its tensor) plus ``floor``."""
    return rtol * scale_of(expected) + floor


def assert_close_to_scale(actual: np.ndarray, expected: np.ndarray, rtol: float, floor: float = 0.0,
                          err_msg: str = "") -> None:
    """Every element of ``actual`` within ``rtol`` of ``expected``'s element plus
    ``tolerance_to_scale``. The test suite's form of ``bridge.tools.verify.scaled_error <= rtol``,
    kept per element (numpy's message names the elements off) and with ``rtol`` of each element on top."""
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=tolerance_to_scale(rtol, expected, floor),
                               err_msg=err_msg)


def random_batches(tm: bridge.TrainingModel, count: int, seed: int = 0, classes: int | None = None,
                   input_shapes: Mapping[str, Sequence[int]] | None = None, input_dtypes: Mapping[str, np.dtype] | None = None) -> list[Batch]:
    """Random inputs with the shapes of the training graph's data inputs, and random targets."""
    rng = np.random.default_rng(seed)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in tm.model.graph.input}
    batches = []
    for _ in range(count):
        inputs = {}
        for name in tm.data_inputs:
            shape = (input_shapes or {}).get(name, shapes[name])
            dtype = (input_dtypes or {}).get(name, np.float32)
            inputs[name] = rng.standard_normal(shape).astype(dtype)
        if np.issubdtype(tm.target_dtype, np.integer):
            target = rng.integers(0, classes or 2, size=tm.target_shape).astype(tm.target_dtype)
        else:
            target = rng.standard_normal(tm.target_shape).astype(tm.target_dtype)
        batches.append((inputs, target))
    return batches


def steps_with_state_edits(session, weights, inputs, target) -> list[dict[str, np.ndarray]]:
    """Two steps of ``session`` on one batch, and between them one of ``weights`` scaled in place, another
    replaced by a new array and an optimizer slot zeroed in place; the steps' outputs, copied."""
    first, second = sorted(weights)[:2]
    slot = next(name for name in sorted(session.state) if name.startswith(first + "."))
    steps = [{name: value.copy() for name, value in session.step(inputs, target).items()}]
    session.state[first] *= 0.5
    session.state[second] = session.state[second] + 1.0
    session.state[slot][...] = 0.0
    steps.append({name: value.copy() for name, value in session.step(inputs, target).items()})
    return steps


def copied_batches(batches: Sequence[Batch]) -> list[Batch]:
    """A copy of every array of ``batches``, for ``assert_batches_unchanged`` after the steps that read them."""
    return [({name: value.copy() for name, value in inputs.items()}, target.copy()) for inputs, target in batches]


def assert_batches_unchanged(batches: Sequence[Batch], copies: Sequence[Batch]) -> None:
    """Every array the caller fed (``batches``) still equals its copy taken before the steps: no session wrote
    into a caller's input."""
    for (inputs, target), (input_copies, target_copy) in zip(batches, copies, strict=True):
        np.testing.assert_array_equal(target, target_copy)
        for name, value in inputs.items():
            np.testing.assert_array_equal(value, input_copies[name], err_msg=name)
