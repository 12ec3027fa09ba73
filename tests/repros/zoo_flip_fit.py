"""Is onnxruntime's first step of a zoo vision model off torch float64 by decision flips alone?

    python tests/repros/zoo_flip_fit.py model[:batch[:attempt]] ...

converts the model's symbolic-batch export (legacy17, Adam lr 1e-2) as tests/test_zoo_vision.py
does, takes one onnxruntime (float32) step at ``batch`` rows of draw ``attempt`` and prints
``zoo.harness.flip_fit`` of it against torch float64 (the function the IREE zoo test uses): which
decisions within float32 rounding (``zoo.harness.near_decisions``) it flipped, each fitted
coefficient, and the worst gradient (in multiples of the tolerance: rtol 1e-4 of the scale + 4x
torch's float32 noise) before and after applying those flips exactly to float64. Coefficients at 0
or 1 and a residual within the tolerance prove that onnxruntime's step is torch's float64 step with
those decisions rounded the other way: a float32 decision, not a wrong graph. A residual that stays
above the tolerance is not explained by decisions (a defect, or a decision outside the near set).
Torch only, minutes per case.

Measured with this script's first version (flips summed, one column per max-pool window;
the test's own conversion; ``worst`` in multiples of the tolerance; with ``flip_fit`` googlenet at 16
is explained: 8 decisions flipped, 1320x -> 0.20x, docs/notes/onnx-mlir-iree-investigations.md section 7):
- resnet18d at 16 (plain draw): 13 near elements, all s = 0.000, worst 0.030: no flip, passes.
- vgg11_bn at 16 (plain draw): s = 1.000 for the features.3 max-pool tie (272753, 272688) and 1.001
  for one features.10 ReLU input (529078), all else |s| < 0.01: worst 0.53 -> 0.069 with both flips.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.exporters import SYMBOLIC_BATCH, export  # noqa: E402
from zoo.harness import flip_fit, module_oracle, name_map  # noqa: E402
from zoo.torch_models import BATCH, VISION  # noqa: E402

import bridge  # noqa: E402
from repros.zoo_activation_near_kink import plain_inputs  # noqa: E402


def fit(name: str, batch: int, attempt: int, folder: Path) -> None:
    module, plain, _, loss = VISION[name](attempt=0)
    path = export(module, plain, SYMBOLIC_BATCH, folder / f"{name}.onnx", dynamic_batch=True)
    mapping = name_map(module, path)[0]
    tm = bridge.to_training_onnx(path, loss=loss, optim="adam", optim_options={"lr": 1e-2},
                                 input_shapes={k: list(v.shape) for k, v in plain.items()})
    _, inputs, target, _ = plain_inputs(name, batch, attempt)
    want, noise = module_oracle(module, mapping, inputs, target, loss, 1e-2)()
    found = flip_fit(module, mapping, inputs, target, loss, 1e-2, tm.session().step(inputs, target), want, noise)
    print(f"{name} at batch {batch}, draw {attempt}: explained {found.explains}: {found}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        for spec in sys.argv[1:]:
            name, *numbers = spec.split(":")
            batch, attempt = [int(n) for n in numbers] + [BATCH, 0][len(numbers):]
            fit(name, batch, attempt, Path(folder))
