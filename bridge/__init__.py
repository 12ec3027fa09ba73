"""bridge: turn an inference ONNX model into an explicit training-step ONNX model."""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    BridgeError,
    InvalidModelError,
    InvalidOptionError,
    LoweringError,
    ModelLoadError,
    OutputPathError,
    ShapeError,
    UnsupportedOpError,
)
from .api import to_training_onnx  # noqa: E402
from .from_torch import export_for_training  # noqa: E402
from .source_checks import BridgeWarning, InferenceExportError, InferenceExportWarning  # noqa: E402
from .compile import CompileError, CompiledModel, MissingExtraError, compile  # noqa: E402,A004
from .runtime import TrainingSession  # noqa: E402
from .training_model import TrainingModel  # noqa: E402
from . import ir  # noqa: E402
from .check import Violation, check  # noqa: E402
from .checks import NonFiniteError, StepInputError  # noqa: E402
from .checkpoint import CheckpointError  # noqa: E402
from .trainer import History, Trainer  # noqa: E402
from .verify import VerifyReport, verify  # noqa: E402

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
