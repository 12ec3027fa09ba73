"""bridge: turn an inference ONNX model into an explicit training-step ONNX model.

The public names below are imported on first use (PEP 562 ``__getattr__``): ``import bridge``
loads only the error classes, so the command line starts fast and a program that only runs a
saved training graph (``bridge.TrainingSession``, ``bridge.ir``) never imports torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BridgeError,
    BridgeWarning,
    InvalidModelError,
    InvalidOptionError,
    LoweringError,
    MissingExtraError,
    ModelLoadError,
    OutputPathError,
    ShapeError,
    UnsupportedOpError,
)

# public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "to_training_onnx": "api",
    "export_for_training": "pipeline.from_torch",
    "InferenceExportError": "pipeline.source_checks",
    "InferenceExportWarning": "pipeline.source_checks",
    "CompileError": "tools.compile",
    "CompiledModel": "tools.compile",
    "compile": "tools.compile",
    "TrainingSession": "training.runtime",
    "TrainingModel": "training.training_model",
    "Violation": "tools.target_check",
    "check": "tools.target_check",
    "NonFiniteError": "training.feed_checks",
    "StepInputError": "training.feed_checks",
    "StepStateLostError": "training.feed_checks",
    "CheckpointError": "training.checkpoint",
    "History": "training.trainer",
    "Trainer": "training.trainer",
    "VerifyReport": "tools.verify",
    "verify": "tools.verify",
}
_SUBMODULES = ("ir",)

if TYPE_CHECKING:
    from . import ir
    from .api import to_training_onnx
    from .pipeline.from_torch import export_for_training
    from .pipeline.source_checks import InferenceExportError, InferenceExportWarning
    from .tools.compile import CompiledModel, CompileError, compile  # noqa: A004
    from .tools.target_check import Violation, check
    from .tools.verify import VerifyReport, verify
    from .training.checkpoint import CheckpointError
    from .training.feed_checks import NonFiniteError, StepInputError, StepStateLostError
    from .training.runtime import TrainingSession
    from .training.trainer import History, Trainer
    from .training.training_model import TrainingModel


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first use (PEP 562) and cache the name."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))


__all__ = [
    "BridgeError",
    "BridgeWarning",
    "CheckpointError",
    "CompileError",
    "MissingExtraError",
    "CompiledModel",
    "InvalidModelError",
    "InvalidOptionError",
    "LoweringError",
    "NonFiniteError",
    "ModelLoadError",
    "OutputPathError",
    "History",
    "InferenceExportError",
    "InferenceExportWarning",
    "ShapeError",
    "StepInputError",
    "StepStateLostError",
    "Trainer",
    "TrainingModel",
    "TrainingSession",
    "UnsupportedOpError",
    "VerifyReport",
    "Violation",
    "check",
    "ir",
    "compile",
    "export_for_training",
    "to_training_onnx",
    "verify",
]
