"""The benchmark models (random weights, fixed seeds): what benchmarks/run.py measures.

Each builder returns a ``BenchModel``: a torch module in train mode (Dropout off, so eager torch
and bridge do the same arithmetic), one fixed batch, its target and the loss name bridge uses
(``ce``: over the last dim for [N, T, V] logits, as ``torch_loss`` computes it). ``MODELS`` are the
step benchmarks; ``STACKS`` build a transformer or a resnet of any number of identical blocks, for
conversion time against depth.
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


class _TransformerBlock(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class _TransformerStack(torch.nn.Module):
    def __init__(self, blocks: int, vocab: int, width: int, heads: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*(_TransformerBlock(width, heads) for _ in range(blocks)))
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


def transformer_stack(blocks: int) -> BenchModel:
    """``blocks`` identical transformer blocks (width 64, 2 heads) between an embedding and a token head."""
    rng = _rng(6)
    vocab, length, batch = 100, 16, 4
    module = _TransformerStack(blocks, vocab, 64, 2)
    return BenchModel(f"transformer_{blocks}", module, {"ids": rng.integers(0, vocab, (batch, length))},
                      rng.integers(0, vocab, (batch, length)))


class _ResidualBlock(torch.nn.Module):
    """resnet's basic block at a fixed width: conv, BatchNorm, ReLU, conv, BatchNorm, the residual, ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1, self.norm2 = torch.nn.BatchNorm2d(channels), torch.nn.BatchNorm2d(channels)
        _untie(self.norm1)
        _untie(self.norm2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x)))))
        return F.relu(x + y)


def resnet_stack(blocks: int) -> BenchModel:
    """``blocks`` identical residual blocks (16 channels) between a conv stem and a pooled classifier."""
    rng = _rng(7)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                 *(_ResidualBlock(16) for _ in range(blocks)),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    return BenchModel(f"resnet_{blocks}", module, {"x": rng.standard_normal((4, 3, 16, 16), np.float32)},
                      rng.integers(0, 10, 4))


STACKS: dict[str, Callable[[int], BenchModel]] = {"transformer": transformer_stack, "resnet": resnet_stack}
