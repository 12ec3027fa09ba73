"""Errors and warnings raised by bridge. Every error names the node, op, file or argument at fault."""


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
