"""Zoo, vision models (torchvision, timm, a tiny ViT; random weights, 64x64 images): first Adam
step vs the torch module itself (running statistics included), trained set, falling loss.

The ``legacy17`` export of a model has a symbolic batch: converted once, it is checked at the
export's batch (first step, trained set, onnx-mlir, the loss falling within 30 steps) and, on the same conversion,
its first step at batch 1, 3 and 16 (zoo/torch_models.py: ``symbolic_batches``). CI (``slow``)
checks each model once, every exporter at least once; the other exports of a model, and models
whose families the others already exercise, are ``exhaustive`` (make test-all).
"""
from __future__ import annotations

import pytest
from zoo.exporters import SYMBOLIC_BATCH, export
from zoo.harness import check_case, module_case
from zoo.torch_models import VISION, draws, symbolic_batches

# Models without a legacy17 export in CI: CI checks them at a static batch; their symbolic-batch
# export is exhaustive. CI keeps the symbolic batch of squeezenet1_1 (a CNN), efficientnet_b0
# (BatchNorm, depthwise Conv, squeeze-excitation), vit_tiny (attention), the text models, and
# test_dynamic_batch.py (MLP, CNN, RNNs, a transformer layer at batch 1, 3 and 16).
SYMBOLIC_EXHAUSTIVE = ("resnet18", "mobilenet_v2", "shufflenet_v2_x0_5", "densenet121", "googlenet", "vgg11_bn",
                       "convnext_atto", "resnet18d", "mobilenetv3_small_050", "regnety_002")
# (model, exporter, Adam lr); dynamo exports skip the exporter's optimizer (``_noopt``), which
# fuses BatchNorm into Conv and folds weights into constants (see docs/models.md), except
# for squeezenet (no BatchNorm), exported both ways. (A dynamo export with a symbolic batch does
# not convert yet: its CastLike nodes fail at a symbolic size.)
MATRIX = [
    ("resnet18", "legacy11", 1e-2), ("resnet18", "legacy13_fold", 1e-2), ("resnet18", "legacy17_functions", 1e-2),
    ("mobilenet_v2", "dynamo18_noopt", 1e-2), ("squeezenet1_1", "legacy17", 1e-3),
    ("squeezenet1_1", "dynamo18", 1e-3), ("shufflenet_v2_x0_5", "legacy17_fold", 1e-2),
    ("efficientnet_b0", "legacy17", 1e-2), ("densenet121", "dynamo18_noopt", 1e-2), ("googlenet", "legacy13", 1e-2),
    ("vgg11_bn", "dynamo20_noopt", 1e-2), ("convnext_atto", "dynamo18_noopt", 1e-2), ("resnet18d", "legacy17_fold", 1e-2),
    ("mobilenetv3_small_050", "legacy13", 1e-2), ("regnety_002", "dynamo20_noopt", 1e-2), ("vit_tiny", "legacy17", 1e-2),
    ("vit_tiny", "dynamo18_noopt", 1e-2),
    *[(name, SYMBOLIC_BATCH, 1e-2) for name in SYMBOLIC_EXHAUSTIVE],
]
# Exhaustive only (make test-all), and what CI keeps instead:
EXHAUSTIVE = {
    "resnet18-legacy11",  # legacy11: BERT (test_zoo_text); resnet18 itself: legacy17_functions
    "resnet18-legacy13_fold",  # legacy13_fold: BERT; a constant-folded BatchNorm export: shufflenet legacy17_fold
    "densenet121-dynamo18_noopt",  # ~2 min alone; concatenated feature maps: googlenet; Conv/BN/pools: resnet18, vgg11_bn
    "resnet18d-legacy17_fold",  # resnet18's residual blocks (resnet18) with an AvgPool shortcut (op_db's AveragePool rows)
    "vit_tiny-dynamo18_noopt",  # the same ViT: vit_tiny legacy17; dynamo18_noopt: mobilenet_v2, convnext_atto
    *[f"{name}-{SYMBOLIC_BATCH}" for name in SYMBOLIC_EXHAUSTIVE],
}
# Elements allowed to miss the tolerance. googlenet: a MaxPool window (channel 97 of maxpool3's
# input) holds two values 1.7e-6 apart (relative), below float32 resolution after 20 layers, so
# which one is the max (and gets the gradient) depends on rounding (0.18% of one tensor).
# ``flip_fit`` does not settle it (the pairs fit at s = 0.38 and 0.49: not 0 or 1), so the allowance stays.
ALLOWED_MISMATCH = {"googlenet": 0.005}
# Deep CNNs drift further from float64 torch than 4x torch's own float32 error at some batch sizes
# only (deterministic; docs/dynamic_batch.md). Every batch size is checked at rtol 1e-4 + 4x torch's
# float32 error; where the direct comparison fails ``zoo.harness.assert_step_or_flips`` accepts only a
# step that ``flip_fit`` proves to be torch float64's with at most 16 near decisions flipped, matched
# at that tolerance with no element allowance (docs/notes/float32_decisions.md).


# Strict xfails (a fixed cause turns them into failures); none now.
XFAIL: dict[str, str] = {}


def _params():
    for name, exporter, lr in MATRIX:
        tier = pytest.mark.exhaustive if f"{name}-{exporter}" in EXHAUSTIVE else pytest.mark.slow
        marks = [tier, *([pytest.mark.xfail(reason=XFAIL[f"{name}-{exporter}"], strict=True)]
                         if f"{name}-{exporter}" in XFAIL else [])]
        yield pytest.param(name, exporter, lr, id=f"{name}-{exporter}", marks=marks)


@pytest.mark.parametrize("name, exporter, lr", list(_params()))
def test_vision_model_trains_like_torch(name, exporter, lr, tmp_path):
    module, inputs, target, loss = VISION[name]()
    symbolic = exporter == SYMBOLIC_BATCH
    path = export(module, inputs, exporter, tmp_path / f"{name}.onnx", dynamic_batch=symbolic)
    check_case(module_case(f"{name}/{exporter}", module, path, inputs, target, loss, lr=lr, rtol=1e-4,
                           allowed_mismatch=ALLOWED_MISMATCH.get(name, 0.0),
                           batches=symbolic_batches(module) if symbolic else (),
                           draws=draws(name, module)))
