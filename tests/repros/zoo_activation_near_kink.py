"""Why IREE's first step of some zoo vision models differs from onnxruntime's: a ReLU/ReLU6 decision
within float32 rounding of its kink, not a miscompiled graph (issue 14; docs/onnx-mlir.md section 5).

    python tests/repros/zoo_activation_near_kink.py [model[:batch] ...]   # default: the four cases below

runs the zoo's torch module (tests/zoo, the same perturbed weights and the batch the IREE zoo test
steps at: the export's batch 2 static, one more, 3, for a symbolic batch; rows drawn as
``zoo.harness.rows`` draws them) forward in training mode in float64 and in float32 and, for every
ReLU / ReLU6 / Hardtanh input, prints the elements whose float64 value lies closer to a kink (0, or 6
for ReLU6) than that tensor's float32 error (the largest |float32 - float64| over the tensor). Such
an element's float32 gradient is 0 or g depending on rounding: one float32 runtime routes the
gradient and another does not, and behind BatchNorms with a few values per channel (2x2 maps) that
one element moves every gradient upstream of it by percents. No IREE needed (torch only, seconds).

Measured (2026-11-30) on ``mobilenet_v2`` at batch 3 with IREE: the only differing tensor element
before the optimizer is ``where_5``, the ReLU6 backward of ``features.18`` (the last BatchNorm, 1280
channels on 2x2 maps): element [0, 212, 0, 0], whose BatchNorm output is +8.8e-6 in onnxruntime and
-1.1e-5 in IREE (the two runtimes' BatchNorm outputs differ by 1.4e-5 median, 1.2e-4 at most, on a
scale of 3.1: float32 rounding of a deep BatchNorm net), so IREE's ReLU6 drops a gradient of 8% of
that tensor's scale; 1 of 15360 elements, and every gradient upstream differs from onnxruntime's by
1-16% of its scale. At batch 2 (a fresh draw of rows; features.18's closest input 7.3e-5 from 0) the
same compiled module matches onnxruntime. An element listed here is at risk, not proven flipped:
resnet18 at batch 3 has some and its IREE step matches (both runtimes round to the same side).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.harness import rows  # noqa: E402
from zoo.torch_models import VISION  # noqa: E402

KINKED = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardtanh)
CASES = ("mobilenet_v2:3", "resnet18d:3", "vgg11_bn:2", "resnet18:3")


def _kinks(module: torch.nn.Module) -> tuple[float, ...]:
    if isinstance(module, torch.nn.Hardtanh):  # ReLU6 is a Hardtanh(0, 6)
        return (module.min_val, module.max_val)
    return (0.0,)


def activation_inputs(module: torch.nn.Module, x: np.ndarray, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Every kinked activation's input in one training-mode forward pass of ``module`` in ``dtype``."""
    seen: dict[str, np.ndarray] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach().double()
                                                                                       .numpy().copy()))
             for name, m in module.named_modules() if isinstance(m, KINKED)]
    try:
        module.to(dtype).train()(torch.from_numpy(x).to(dtype))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def near_kink(name: str, batch: int) -> list[tuple[str, int, float, float]]:
    """(activation, elements within float32 error of a kink, the closest one's distance, the error)."""
    module, inputs, _, _ = VISION[name]()
    x = inputs["x"] if batch == len(inputs["x"]) else rows(inputs["x"], batch)
    kinks = {n: _kinks(m) for n, m in module.named_modules() if isinstance(m, KINKED)}
    wide = activation_inputs(module, x, torch.float64)
    single = activation_inputs(module, x, torch.float32)
    found = []
    for key, value in wide.items():
        error = float(np.max(np.abs(single[key] - value)))
        distance = np.min([np.abs(value - k) for k in kinks[key]], axis=0)
        close = int(np.sum(distance < error))
        if close:
            found.append((key, close, float(distance.min()), error))
    return found


if __name__ == "__main__":
    for case in sys.argv[1:] or CASES:
        name, _, batch = case.partition(":")
        hits = near_kink(name, int(batch or 2))
        print(f"{name} at batch {batch or 2}: {len(hits)} activation(s) with inputs within float32 error of a kink")
        for key, count, distance, error in hits:
            print(f"  {key}: {count} element(s), closest {distance:.2e} from the kink, float32 error {error:.2e}")
