"""Why IREE's first step of some zoo vision models differed from onnxruntime's: a ReLU/ReLU6 or
max-pool decision within float32 rounding, not a miscompiled graph (issue 14; docs/notes/onnx-mlir-iree-investigations.md
section 7).

    python tests/repros/zoo_activation_near_kink.py [model[:batch[:attempt]] ...]   # default: the cases below

runs the zoo's torch module (tests/zoo, the same perturbed weights) on its PLAIN draw (attempt 0:
the data the zoo used before it drew data off decisions; batch 2 is the export's batch, another
batch is drawn as ``zoo.harness.rows`` draws it) forward in training mode in float64 and in float32
and prints ``zoo.harness.near_decisions``: for every kinked activation (ReLU, ReLU6/Hardtanh,
LeakyReLU, Hardswish, Hardsigmoid, clamp) the elements whose float64 input lies closer to a kink,
and for every max pool the windows whose two largest inputs lie closer to each other, than
NOISE_FACTOR x that input's float32 error (RMS of |float32 - float64| over the tensor). Such an
element's float32 gradient is 0 or g (or goes to one element or the other) depending on rounding:
one float32 runtime routes the gradient and another does not, and behind BatchNorms with a few
values per channel (2x2 maps) that one element moves every gradient upstream of it by percents:
each line also gives the flips' exact float64 effect on the gradients, as a multiple of the zoo's
tolerance (``zoo.harness._flip_effects``). The zoo uses the first draw whose flips all stay below
it (``zoo.harness.safe_attempt``, recorded in ``zoo.torch_models.DRAWS``). No IREE needed.

Measured on ``mobilenet_v2`` at batch 3 with IREE: the only differing tensor element
before the optimizer is ``where_5``, the ReLU6 backward of ``features.18`` (the last BatchNorm, 1280
channels on 2x2 maps): element [0, 212, 0, 0], whose BatchNorm output is +8.8e-6 in onnxruntime and
-1.1e-5 in IREE (1.5e-5 in float64), so IREE's ReLU6 drops a gradient of 8% of that tensor's scale;
1 of 15360 elements, and every gradient upstream differs from onnxruntime's by 1-16% of its scale.
An element listed here is at risk, not proven flipped: resnet18 at batch 3 has some and its IREE
step matched (both runtimes rounded to the same side). resnet18d at batch 3 (plain draw): onnxruntime
flipped layer4.0's ReLUs (flip effects 893x and 730x the tolerance) and missed torch float64 by
0.4-7.5% of every gradient from layer4.0 upstream, while IREE matched float64.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.harness import batch_rows, flip_effect, near_decisions  # noqa: E402
from zoo.torch_models import BATCH, VISION  # noqa: E402

CASES = ("mobilenet_v2:3", "resnet18d:3", "vgg11_bn:2", "resnet18:3")


def plain_inputs(name: str, batch: int, attempt: int = 0):
    """(module, float inputs, target, loss) of zoo model ``name``: its draw ``attempt`` at ``batch`` rows."""
    module, inputs, target, loss = VISION[name](attempt=attempt if batch == BATCH else 0)
    if batch != BATCH:
        inputs, target = batch_rows(inputs, target, batch, attempt)
    return module, inputs, target, loss


if __name__ == "__main__":
    for case in sys.argv[1:] or CASES:
        name, *numbers = case.split(":")
        batch, attempt = [int(n) for n in numbers] + [BATCH, 0][len(numbers):]
        hits = near_decisions(*plain_inputs(name, batch, attempt))
        print(f"{name} at batch {batch}, draw {attempt}: {len(hits)} decision op(s) with elements within float32 "
              f"rounding of the decision; their flips can move a gradient {flip_effect(hits):.3g}x its tolerance")
        for where, count, distance, error, effect in hits:
            print(f"  {where}: {count} element(s), closest {distance:.2e} from the decision, float32 error {error:.2e}, "
                  f"flip effect {effect:.3g}x a gradient's tolerance")
