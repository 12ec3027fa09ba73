"""The zoo models a compiled backend (IREE, onnx-mlir) steps against onnxruntime: tests/test_iree_zoo.py
and tests/test_onnx_mlir_zoo.py take their params, torch cases and step timings from here."""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

import bridge


def zoo_params():
    """One pytest param (kind, name, mode) per zoo model: hand-built (static), torchvision, vision and
    text (static and symbolic batch)."""
    from .handbuilt import CASES
    from .torch_models import TEXT, VISION

    for build in CASES:
        yield pytest.param("handbuilt", build.__name__, "static", id=f"{build.__name__}-static")
    for kind, names in (("torchvision", TORCHVISION), ("vision", VISION), ("text", TEXT)):
        for name in names:
            for mode in ("static", "dynamic"):
                yield pytest.param(kind, name, mode, id=f"{name}-{mode}")


def torchvision_model(name: str, size: int):
    """torchvision ``name`` (10 classes, perturbed weights) on a batch of 8 ``size`` x ``size`` images."""
    import torchvision

    from .harness import perturb
    from .torch_models import _classes

    torch.manual_seed(30)
    module = perturb(getattr(torchvision.models, name)(weights=None, num_classes=10), 30)
    inputs = {"x": np.random.default_rng(30).standard_normal((8, 3, size, size)).astype(np.float32)}
    return module, inputs, _classes(30, 10, (8,)), "ce"


TORCHVISION = {f"{name}@{size}": functools.partial(torchvision_model, name, size)
               for name in ("resnet18", "mobilenet_v3_small") for size in (32, 64)}
def torch_case(kind: str, name: str, mode: str, tmp_path, convert_for: str = "onnxruntime"):
    """(case, training model, flip fit) for a torch zoo module exported with a symbolic batch and converted
    for ``convert_for`` (bridge's form target); the fit takes a runtime's first step and the float64 oracle's
    (step, noise) (``zoo.harness.flip_fit``)."""
    from test_zoo_vision import ALLOWED_MISMATCH

    from .exporters import SYMBOLIC_BATCH, export
    from .harness import Case, batch_rows, flip_fit, module_oracle, name_map
    from .torch_models import TEXT, VISION, drawn_attempt

    module, inputs, target, loss = {**TEXT, **VISION, **TORCHVISION}[name]()
    path = export(module, inputs, SYMBOLIC_BATCH, tmp_path / "model.onnx", dynamic_batch=True)
    shapes = {k: list(v.shape) for k, v in inputs.items()}
    tm = bridge.to_training_onnx(path, loss=loss, optim="adam", optim_options={"lr": 1e-3}, input_shapes=shapes,
                                 dynamic_batch=mode == "dynamic", target=convert_for)
    if mode == "dynamic":  # a batch size the graph was not traced with (one more: BatchNorm on 1x1 maps
        batch = len(target) + 1  # at batch 3 is too ill-conditioned for float32, docs/dynamic_batch.md)
        # the draw the zoo uses there: no float32 decision flip moves a gradient past tolerance (DRAWS)
        inputs, target = batch_rows(inputs, target, batch, drawn_attempt(name, batch))
    mapping, _ = name_map(module, path)
    oracle = module_oracle(module, mapping, inputs, target, loss, 1e-3)
    case = Case(f"{name}/{mode}", path, inputs, target, loss, set(tm.weights), oracle, lr=1e-3, rtol=1e-4,
                allowed_mismatch=ALLOWED_MISMATCH.get(name, 0.0))
    return case, tm, functools.partial(flip_fit, module, mapping, inputs, target, loss, 1e-3)


def median_step_seconds(session, inputs, target, repeats: int = 3) -> float:
    """The median wall time of ``repeats`` steps of ``session`` on one batch."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.step(inputs, target)
        times.append(time.perf_counter() - start)
    return float(np.median(times))
