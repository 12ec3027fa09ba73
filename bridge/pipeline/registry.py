"""What bridge's three registries share: ``@converter`` (ONNX op -> torch, ``bridge.pipeline.importer.registry``),
``@lowers`` (ATen op -> ATen ops, ``bridge.pipeline.lowering``) and ``@emits`` (ATen op -> ONNX,
``bridge.pipeline.export.builder``).

Each registry is a dict filled by decorators in the modules of one package (one module per op
family); ``import_submodules`` imports them all, and ``register`` refuses a second entry for a
key, so that two families can never silently replace each other's function.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def register(table: MutableMapping[Any, Any], key: Any, value: Any, what: str) -> None:
    """``table[key] = value``; ``RuntimeError`` naming both functions if ``key`` is taken.

    ``what`` names the entry for the message, e.g. ``"converters for ONNX op"``."""
    if key in table:
        raise RuntimeError(f"two {what} {key}: {_name(table[key])} and {_name(value)}")
    table[key] = value


def registering(table: MutableMapping[Any, Any], keys: Iterable[Any], what: str) -> Callable[[F], F]:
    """A decorator: registers its function under each of ``keys`` (``register``), returns it unchanged."""

    def add(fn: F) -> F:
        for key in keys:
            register(table, key, fn, what)
        return fn

    return add


def import_submodules(package: str) -> None:
    """Import every module of ``package`` (a dotted name), so that their decorators register."""
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        importlib.import_module(f"{package}.{info.name}")


def function_name(fn: Any) -> str:
    """``module.function`` of a registered function (a ``functools.partial``: of the function it wraps)."""
    fn = getattr(fn, "func", fn)
    return f"{fn.__module__}.{fn.__qualname__}"


def _name(value: Any) -> str:
    return function_name(getattr(value, "fn", value))
