"""A small CNN with BatchNorm and Dropout, exported as users export it (legacy exporter, training
mode kept so BatchNorm and Dropout stay nodes), and the torch side of the lifecycle tests."""
from __future__ import annotations

import io
import warnings
from collections import OrderedDict

import numpy as np
import onnx
import torch

CLASSES, CHANNELS, SIZE = 5, 4, 8


class SmallCNN(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU -> Dropout -> Linear; ``mask`` (when set) replaces Dropout's draw."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, CHANNELS, 3)
        self.bn = torch.nn.BatchNorm2d(CHANNELS)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(CHANNELS * (SIZE - 2) ** 2, CLASSES)
        self.mask: torch.Tensor | None = None

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        h = self.drop(h) if self.mask is None else h * self.mask / 0.5
        return self.fc(h)


def small_cnn(seed: int = 0, dynamic: bool = True) -> tuple[SmallCNN, onnx.ModelProto]:
    """The module (seeded) and its ONNX export (input ``x``, output ``y``; batch symbolic if ``dynamic``)."""
    torch.manual_seed(seed)
    module = SmallCNN()
    with torch.no_grad():  # running statistics that are not the defaults, so eval mode is visible
        module.bn.running_mean.uniform_(-0.5, 0.5)
        module.bn.running_var.uniform_(0.5, 2.0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.train(), (torch.randn(6, 1, SIZE, SIZE),), buffer, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}} if dynamic else None)
    return module, onnx.load_from_string(buffer.getvalue())


def batch(count: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random images and class indices."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, 1, SIZE, SIZE)).astype(np.float32)
    return {"x": x}, rng.integers(0, CLASSES, count).astype(np.int64)


def load_state(module: torch.nn.Module, state: dict[str, np.ndarray]) -> torch.nn.Module:
    """``module`` with the weights and running statistics of a session's state (torch names)."""
    names = module.state_dict().keys()
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items() if k in names}, strict=False)
    return module


def assert_close_to_float64(got: np.ndarray, want32: np.ndarray, want64: np.ndarray, factor: float = 16.0) -> None:
    """``got`` (bridge, float32) is as close to torch's float64 result as torch's own float32 result
    is, within ``factor`` times that measured float32 noise (plus 1 ulp of the result's scale)."""
    noise = float(np.max(np.abs(want32 - want64)))
    scale = float(np.max(np.abs(want64)))
    error = float(np.max(np.abs(got - want64)))
    assert error <= factor * noise + np.finfo(np.float32).eps * scale, f"error {error:.3g}, float32 noise {noise:.3g}"


def small_mlp(seed: int = 0) -> tuple[torch.nn.Module, onnx.ModelProto]:
    """A deterministic classifier (no Dropout, no BatchNorm): 6 features -> CLASSES logits, dynamic batch."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, CLASSES))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(4, 6),), buffer, dynamo=False, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return module, onnx.load_from_string(buffer.getvalue())


def features(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random feature rows for ``small_mlp`` and class indices."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, 6)).astype(np.float32), rng.integers(0, CLASSES, count).astype(np.int64)


def mlp_and_data() -> tuple[torch.nn.Module, onnx.ModelProto, torch.Tensor, torch.Tensor]:
    """Linear -> ReLU -> Linear (6 -> 8 -> 3) exported by the legacy exporter (input x, output y), and a batch of 5."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["x"], output_names=["y"])
    return module, onnx.load_from_string(buffer.getvalue()), x, y


# bridge's LoRA targets for the models LoRA is proven on (tests/test_lora.py, tests/test_lora_compiled.py)
LORA_TARGETS = {"bert_tiny": ["*attention*", "*intermediate*", "*output.dense*"], "gpt2_tiny": ["*attn*", "*mlp*"],
                "cnn": ["conv*", "head*"]}


def lora_cnn() -> tuple[torch.nn.Module, dict[str, np.ndarray], np.ndarray, str]:
    """Two Convs (one strided) -> ReLU -> global average pool -> Linear, a batch of 3 8x8 RGB images and
    class indices, and its loss: the CNN that LoRA's Conv adapters are tested on."""
    torch.manual_seed(3)
    module = torch.nn.Sequential(OrderedDict(
        conv1=torch.nn.Conv2d(3, 6, 3, padding=1), relu1=torch.nn.ReLU(),
        conv2=torch.nn.Conv2d(6, 8, 3, stride=2, padding=1), relu2=torch.nn.ReLU(),
        pool=torch.nn.AdaptiveAvgPool2d(1), flat=torch.nn.Flatten(), head=torch.nn.Linear(8, 4)))
    rng = np.random.default_rng(3)
    return module, {"x": rng.standard_normal((3, 3, 8, 8)).astype(np.float32)}, rng.integers(0, 4, 3), "ce"
