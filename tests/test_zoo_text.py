"""Zoo, text models (HF BERT / DistilBERT / GPT-2 from tiny configs, an LSTM tagger), each
exported several ways: first Adam step vs the torch module itself, trained set, falling loss.
The ``legacy17`` export of a model has a symbolic batch: the same conversion is also checked at
batch 1, 3 and 16 (see test_zoo_vision.py)."""
from __future__ import annotations

import functools

import pytest
from zoo.exporters import SYMBOLIC_BATCH, export
from zoo.harness import check_case, module_case
from zoo.torch_models import TEXT, symbolic_batches

# (model, exporter, external data). GPT-2 is not exported with constant folding: it unties the
# embedding from the LM head (see docs/models.md).
MATRIX = [
    ("bert", "legacy11", False), ("bert", "legacy13_fold", False), ("bert", "legacy17", False), ("bert", "dynamo18_noopt", False),
    ("distilbert", "legacy13", False), ("distilbert", "legacy17_fold", False), ("distilbert", "dynamo18_noopt", True),
    ("gpt2", "legacy13", False), ("gpt2", "legacy17", False), ("gpt2", "dynamo20_noopt", False),
    ("lstm_tagger", "legacy13", False), ("lstm_tagger", "legacy17", False),
    ("distilbert", "legacy17", False),  # exhaustive: its symbolic batch (CI: BERT's, GPT-2's, the LSTM tagger's)
]
# Exhaustive only (make test-all): the extra exports of a model whose exporter another CI case
# already converts, and what CI keeps instead.
EXHAUSTIVE = {
    "distilbert-legacy17",
    "bert-dynamo18_noopt",  # BERT: legacy11, legacy13_fold, legacy17; a dynamo transformer: gpt2-dynamo20_noopt
    "distilbert-legacy13",  # DistilBERT: dynamo18_noopt-external; legacy13: googlenet, mobilenetv3_small_050
    "distilbert-legacy17_fold",  # a folded transformer: bert-legacy13_fold; legacy17_fold: shufflenet_v2_x0_5
    "gpt2-legacy13",  # GPT-2: legacy17 (symbolic batch), dynamo20_noopt; legacy13: googlenet, mobilenetv3_small_050
    "lstm_tagger-legacy13",  # the tagger: legacy17 (symbolic batch), and this export in test_verify.py (bridge verify)
}


def _params():
    for name, exporter, external in MATRIX:
        tier = pytest.mark.exhaustive if f"{name}-{exporter}" in EXHAUSTIVE else pytest.mark.slow
        yield pytest.param(name, exporter, external, id=f"{name}-{exporter}{'-external' if external else ''}", marks=tier)


@functools.cache
def _built(name):
    return TEXT[name]()


@pytest.mark.parametrize("name, exporter, external", list(_params()))
def test_text_model_trains_like_torch(name, exporter, external, tmp_path):
    module, inputs, target, loss = _built(name)
    symbolic = exporter == SYMBOLIC_BATCH
    path = export(module, inputs, exporter, tmp_path / f"{name}.onnx", external=external, dynamic_batch=symbolic)
    check_case(module_case(f"{name}/{exporter}", module, path, inputs, target, loss, lr=1e-2, rtol=1e-4,
                           batches=symbolic_batches(module) if symbolic else ()))
