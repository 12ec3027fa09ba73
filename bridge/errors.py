"""Errors and warnings raised by bridge. Every error names the node, op, file or argument at fault."""
from __future__ import annotations

import numbers
from typing import overload


class BridgeError(Exception):
    """Base class of every error bridge raises on purpose."""


class BridgeWarning(UserWarning):
    """Base class of the warnings bridge gives on purpose."""


class ModelLoadError(BridgeError):
    """The input is missing, is not an ONNX model, or fails the ONNX checker."""


class UnsupportedOpError(BridgeError):
    """The model uses ONNX ops (or attributes) that bridge cannot import."""


class InvalidOptionError(BridgeError, ValueError):
    """An unknown loss/optimizer name, an unknown option, or an invalid option value."""


class LoweringError(BridgeError):
    """A traced ATen op has no lowering to standard ONNX ops."""


class ShapeError(BridgeError):
    """A shape requirement is not met (e.g. a dynamic batch through a hard-coded reshape)."""


class InvalidModelError(BridgeError, ValueError):
    """The model loads but cannot be trained as given (e.g. nothing in it is trainable)."""


class OutputPathError(BridgeError, OSError):
    """An output path cannot be written (a folder, under a regular file, not writable, or the input itself)."""


class MissingExtraError(BridgeError, ImportError):
    """An optional dependency of bridge is not installed; the message names the install extra."""


@overload
def positive_int(value: object, option: str) -> int: ...
@overload
def positive_int(value: object, option: str, none_means: str) -> int | None: ...
def positive_int(value: object, option: str, none_means: str | None = None) -> int | None:
    """``value`` of option ``option`` as an int >= 1 (a numpy integer too, a bool not), else
    ``InvalidOptionError`` naming the option. With ``none_means`` (what None stands for, in the
    message), None is valid too and returned as it is."""
    if value is None and none_means is not None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        alternative = f", or None for {none_means}" if none_means is not None else ""
        raise InvalidOptionError(f"{option}={value!r} is not valid; give an integer >= 1{alternative}")
    return int(value)
