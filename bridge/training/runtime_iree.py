"""Run training steps of a compiled training module (``.vmfb``, ``bridge.compile``) with IREE.

``IreeTrainingSession`` has the interface of the onnxruntime ``TrainingSession`` (same inputs,
``updated_*`` fed back, ``.state``, ``.lr``), so one training loop can use either backend.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ..contract import INPUT_SPECS, INPUTS, OUTPUTS, decode_random_inputs
from ..errors import InvalidOptionError, MissingExtraError, ModelLoadError
from .feed_checks import StepChecks
from .runtime import SessionGraph, StepSession, graph_hash

if TYPE_CHECKING:
    from ..tools.compile import CompiledModel

def require_iree(part: str = "compiler") -> None:
    """Raise ``MissingExtraError`` naming ``pip install bridge[iree]`` unless IREE's ``part`` imports."""
    try:
        __import__(f"iree.{part}")
    except ImportError as exc:
        raise MissingExtraError(
            f"IREE ({'iree-base-compiler' if part == 'compiler' else 'iree-base-runtime'}) is not installed: "
            f"pip install 'bridge[iree]' ({exc})"
        ) from exc


class IreeTrainingSession(StepSession):
    """Train with a compiled training module: ``session.step(inputs, target)`` -> outputs."""

    def __init__(self, module: CompiledModel | bytes | str | os.PathLike, state: Mapping[str, np.ndarray],
                 driver: str = "local-task", seed: int | None = None, *,
                 training_model: onnx.ModelProto | None = None, eval_model: onnx.ModelProto | None = None,
                 on_nonfinite: str = "raise"):
        """``training_model``, the ONNX graph the module was compiled from, enables the batch checks
        and makes checkpoints interchangeable with onnxruntime sessions of that graph (same hash);
        ``eval_model`` enables ``evaluate`` (run in onnxruntime on this session's state)."""
        require_iree("runtime")
        import iree.runtime as rt

        if not isinstance(module, (bytes, str, os.PathLike)):
            module = module.vmfb  # a bridge.tools.compile.CompiledModel
        if not isinstance(module, bytes):
            path = Path(module)
            if not path.is_file():
                raise ModelLoadError(f"no such compiled module: {path}")
            module = path.read_bytes()
        checks = None if training_model is None else StepChecks.from_model(training_model)
        super().__init__(state, seed, checks=checks, on_nonfinite=on_nonfinite,
                         graph_hash=graph_hash(module if training_model is None else training_model),
                         eval_model=eval_model)
        self._config = rt.Config(driver)
        try:
            vm_module = rt.VmModule.copy_buffer(self._config.vm_instance, module)
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"not an IREE module (.vmfb): {exc}") from exc
        entry = _entry_function(vm_module)
        reflection = vm_module.lookup_function(entry).reflection
        self.input_names = json.loads(reflection[INPUTS])
        self.output_names = json.loads(reflection[OUTPUTS])
        specs = json.loads(reflection.get(INPUT_SPECS, "{}"))
        for name in decode_random_inputs(reflection):
            shape, dtype = specs[name]
            self.random_inputs[name] = (shape, np.dtype(dtype))
        self._function = getattr(rt.load_vm_module(vm_module, self._config), entry)
        # id of a host array a step returned -> (that array, its IREE buffer), so that the array fed back as
        # the next step's input goes in as the buffer it views instead of being copied into a new one
        self._device_values: dict[int, tuple[np.ndarray, object]] = {}

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feed]
        if missing:
            raise InvalidOptionError(f"missing inputs {missing}; the module takes {self.input_names}")
        results = self._function(*(self._argument(feed[name]) for name in self.input_names))
        if len(self.output_names) == 1:
            results = (results,)
        host = {name: value.to_host() for name, value in zip(self.output_names, results, strict=True)}
        # only a mapped buffer (host memory, the local drivers') is the host array: a copy could be edited apart
        self._device_values = {id(array): (array, value) for array, value in zip(host.values(), results, strict=True)
                               if value._is_mappable()}
        return host

    def _argument(self, value):
        """``value`` as the module's argument: the IREE buffer it maps when the last step returned it
        (the host array is a view of that buffer, so both hold the same numbers), else a C-ordered array."""
        returned = self._device_values.get(id(value))
        if returned is not None and returned[0] is value:
            return returned[1]
        return np.asarray(value, order="C")


def _entry_function(vm_module) -> str:
    """The (synchronous) function that ``bridge.compile`` tagged with the graph's input names."""
    for name in vm_module.function_names:
        if "$" in name:  # IREE's generated variants (``<name>$async`` takes fences)
            continue
        function = vm_module.lookup_function(name)
        if function is not None and INPUTS in function.reflection:
            return name
    raise ModelLoadError("the module was not compiled by bridge.compile (no function lists its inputs)")


class IreeGraph(SessionGraph):
    """A compiled graph (``module``, compiled from ``model``) called like ``bridge.training.runtime.OrtGraph``."""

    def __init__(self, module: bytes, model: onnx.ModelProto):
        super().__init__(IreeTrainingSession(module, {}, training_model=model))
