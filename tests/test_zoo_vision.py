"""Zoo, vision models (torchvision, timm, a tiny ViT; random weights, 64x64 images), each
exported one way (together they cover every exporter): first Adam step vs the torch module
itself (running statistics included), trained set, falling loss."""
from __future__ import annotations

import pytest

from zoo.exporters import export
from zoo.harness import check_case, module_case
from zoo.torch_models import VISION

MATRIX = [
    ("resnet18", "legacy13_fold"), ("mobilenet_v2", "dynamo18"), ("squeezenet1_1", "legacy17"),
    ("shufflenet_v2_x0_5", "legacy17_fold"), ("efficientnet_b0", "legacy17"), ("densenet121", "dynamo18"),
    ("googlenet", "legacy13"), ("vgg11_bn", "dynamo20"), ("convnext_atto", "dynamo18"),
    ("resnet18d", "legacy17_fold"), ("mobilenetv3_small_050", "legacy13"), ("regnety_002", "dynamo20"),
    ("vit_tiny", "legacy17"), ("vit_tiny", "dynamo18"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", MATRIX, ids=[f"{m}-{e}" for m, e in MATRIX])
def test_vision_model_trains_like_torch(name, exporter, tmp_path):
    module, inputs, target, loss = VISION[name]()
    path = export(module, inputs, exporter, tmp_path / f"{name}.onnx")
    check_case(module_case(f"{name}/{exporter}", module, path, inputs, target, loss, lr=1e-2, rtol=1e-4))
