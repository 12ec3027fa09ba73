"""The benchmark models (random weights, fixed seeds): what issue 18's step-time figures measure.

Each builder returns a ``BenchModel``: a torch module in train mode (Dropout off, so eager torch
and bridge do the same arithmetic), one fixed batch, its target and the loss name bridge uses
(``ce``: over the last dim for [N, T, V] logits, as ``torch_loss`` computes it).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bridge.pipeline.from_torch import HFLogits


@dataclass
class BenchModel:
    name: str
    module: torch.nn.Module
    inputs: dict[str, np.ndarray]
    target: np.ndarray
    loss: str = "ce"

    def export(self, path: Path, training: bool = False) -> Path:
        """The legacy exporter at opset 17, no constant folding, eval mode: every weight and
        BatchNorm stays an initializer under its torch name (see docs/models.md). ``training``:
        exported in training mode (BatchNorm with batch statistics), for onnxruntime-training."""
        args = tuple(torch.from_numpy(v) for v in self.inputs.values())
        mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
        self.module.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(self.module, args, str(path), dynamo=False, opset_version=17, do_constant_folding=False,
                              input_names=list(self.inputs), output_names=["y"], training=mode)
        self.module.train()
        return path


def torch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """bridge's ``ce``: classes on the last dim of a [N, T, V] output."""
    if output.dim() == 3:
        return F.cross_entropy(output.flatten(0, 1), target.flatten())
    return F.cross_entropy(output, target)


def _rng(seed: int) -> np.random.Generator:
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def mlp() -> BenchModel:
    rng = _rng(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return BenchModel("mlp", module, {"x": rng.standard_normal((32, 64), np.float32)}, rng.integers(0, 10, 32))


def small_cnn() -> BenchModel:
    rng = _rng(1)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10),
    )
    return BenchModel("small_cnn", module, {"x": rng.standard_normal((16, 3, 32, 32), np.float32)},
                      rng.integers(0, 10, 16))


def _untie(norm: torch.nn.BatchNorm2d) -> None:
    """Distinct BatchNorm scales and shifts (freshly initialised ones are all 1 and 0): the legacy
    exporter de-duplicates equal tensors, and bridge would then train one tied weight where torch
    trains 40 (resnet18), a smaller step than torch's."""
    with torch.no_grad():
        norm.weight.uniform_(0.9, 1.1)
        norm.bias.uniform_(-0.1, 0.1)


def _torchvision(name: str, seed: int) -> BenchModel:
    import torchvision

    rng = _rng(seed)
    module = getattr(torchvision.models, name)(weights=None, num_classes=10)
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.BatchNorm2d):
            _untie(m)
    return BenchModel(name, module, {"x": rng.standard_normal((8, 3, 64, 64), np.float32)}, rng.integers(0, 10, 8))


VOCAB, SEQ, BATCH = 1000, 32, 8


def _text(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(1, VOCAB, (BATCH, SEQ)), "attention_mask": np.ones((BATCH, SEQ), np.int64)}


def bert_tiny() -> BenchModel:
    from transformers import BertConfig, BertForSequenceClassification

    rng = _rng(2)
    config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BenchModel("bert_tiny", HFLogits(BertForSequenceClassification(config)), _text(rng), rng.integers(0, 2, BATCH))


def gpt2_tiny() -> BenchModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    rng = _rng(3)
    config = GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return BenchModel("gpt2_tiny", HFLogits(GPT2LMHeadModel(config)), _text(rng), rng.integers(0, VOCAB, (BATCH, SEQ)))


MODELS: dict[str, Callable[[], BenchModel]] = {
    "mlp": mlp,
    "small_cnn": small_cnn,
    "resnet18": lambda: _torchvision("resnet18", 4),
    "mobilenet_v3_small": lambda: _torchvision("mobilenet_v3_small", 5),
    "bert_tiny": bert_tiny,
    "gpt2_tiny": gpt2_tiny,
}
