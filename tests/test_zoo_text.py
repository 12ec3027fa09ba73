"""Zoo, text models (HF BERT / DistilBERT / GPT-2 from tiny configs, an LSTM tagger), each
exported several ways: first Adam step vs the torch module itself, trained set, falling loss."""
from __future__ import annotations

import functools

import pytest

from zoo.exporters import export
from zoo.harness import check_case, module_case
from zoo.torch_models import TEXT

# (model, exporter, external data). GPT-2 is not exported with constant folding: it unties the
# embedding from the LM head (see docs/models.md).
MATRIX = [
    ("bert", "legacy11", False), ("bert", "legacy13_fold", False), ("bert", "legacy17", False), ("bert", "dynamo18_noopt", False),
    ("distilbert", "legacy13", False), ("distilbert", "legacy17_fold", False), ("distilbert", "dynamo18_noopt", True),
    ("gpt2", "legacy13", False), ("gpt2", "legacy17", False), ("gpt2", "dynamo20_noopt", False),
    ("lstm_tagger", "legacy13", False), ("lstm_tagger", "legacy17", False),
]


@functools.cache
def _built(name):
    return TEXT[name]()


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter, external", MATRIX,
                         ids=[f"{m}-{e}{'-external' if x else ''}" for m, e, x in MATRIX])
def test_text_model_trains_like_torch(name, exporter, external, tmp_path):
    module, inputs, target, loss = _built(name)
    path = export(module, inputs, exporter, tmp_path / f"{name}.onnx", external=external)
    check_case(module_case(f"{name}/{exporter}", module, path, inputs, target, loss, lr=1e-2, rtol=1e-4))
