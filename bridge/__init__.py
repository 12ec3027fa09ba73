"""bridge: turn an inference ONNX model into an explicit training-step ONNX model.

The public names below are imported on first use (PEP 562 ``__getattr__``): ``import bridge``
loads only the error classes, so the command line starts fast and a program that only runs a
saved training graph (``bridge.TrainingSession``, ``bridge.ir``) never imports torch.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BridgeError,
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
    "export_for_training": "from_torch",
    "BridgeWarning": "source_checks",
    "InferenceExportError": "source_checks",
    "InferenceExportWarning": "source_checks",
    "CompileError": "compile",
    "CompiledModel": "compile",
    "compile": "compile",
    "TrainingSession": "runtime",
    "TrainingModel": "training_model",
    "Violation": "check",
    "check": "check",
    "NonFiniteError": "checks",
    "StepInputError": "checks",
    "CheckpointError": "checkpoint",
    "History": "trainer",
    "Trainer": "trainer",
    "VerifyReport": "verify",
    "verify": "verify",
}
_SUBMODULES = ("ir",)

if TYPE_CHECKING:
    from . import ir
    from .api import to_training_onnx
    from .check import Violation, check
    from .checkpoint import CheckpointError
    from .checks import NonFiniteError, StepInputError
    from .compile import CompileError, CompiledModel, compile  # noqa: A004
    from .from_torch import export_for_training
    from .runtime import TrainingSession
    from .source_checks import BridgeWarning, InferenceExportError, InferenceExportWarning
    from .trainer import History, Trainer
    from .training_model import TrainingModel
    from .verify import VerifyReport, verify


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


class _Package(types.ModuleType):
    """``bridge``'s module type: importing the submodule ``bridge.compile`` (``check``, ``verify``)
    must not rebind the public function of that name (the import system sets the submodule as an
    attribute of its package); the function is bound on first use by ``__getattr__``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
