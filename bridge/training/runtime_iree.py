"""Run training steps of a compiled training module (``.vmfb``, ``bridge.compile``) with IREE.

``IreeTrainingSession`` has the interface of the onnxruntime ``TrainingSession`` (same inputs,
``updated_*`` fed back, ``.state``, ``.lr``), so one training loop can use either backend.

The state stays resident between steps: each ``updated_*`` output is a host-mapped view of IREE's result
buffer, and while ``.state`` still holds that very array the next step passes the buffer itself instead of
copying the array into a new one (weights and optimizer slots are most of a step's inputs). Writes into the
array are writes into the buffer; an array put in its place is copied as any input is.

A module compiled with ``in_place=True`` lists under ``IN_PLACE`` the state that the step overwrites in its
own buffer: for those, ``updated_*`` is a view of the argument's buffer (a copy of an array given from
outside is made first, so the caller's array is never written), and a step's values replace the previous
step's in the same memory: copy what must outlive the next step.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ..contract import (
    IN_PLACE,
    INPUT_SPECS,
    INPUTS,
    OUTPUTS,
    UPDATED_PREFIX,
    decode_random_inputs,
    strip_prefix,
    updated_name,
)
from ..errors import InvalidOptionError, MissingExtraError, ModelLoadError
from .runtime import SessionGraph, StepSession, compiled_identity, compiled_module

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
        module, _ = compiled_module(module, "compiled module")
        super().__init__(state, seed, on_nonfinite=on_nonfinite, eval_model=eval_model,
                         **compiled_identity(module, training_model))
        self._config = rt.Config(driver)
        try:
            vm_module = rt.VmModule.copy_buffer(self._config.vm_instance, module)
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"not an IREE module (.vmfb): {exc}") from exc
        entry = _entry_function(vm_module)
        reflection = vm_module.lookup_function(entry).reflection
        self.input_names = json.loads(reflection[INPUTS])
        self.output_names = json.loads(reflection[OUTPUTS])
        self._set_in_place(json.loads(reflection.get(IN_PLACE, "[]")))
        specs = json.loads(reflection.get(INPUT_SPECS, "{}"))
        for name in decode_random_inputs(reflection):
            shape, dtype = specs[name]
            self.random_inputs[name] = (shape, np.dtype(dtype))
        self._function = getattr(rt.load_vm_module(vm_module, self._config), entry)
        self._rt = rt
        self._resident: dict[str, tuple[np.ndarray, object]] = {}  # state name -> (host view, its device array)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feed]
        if missing:
            raise InvalidOptionError(f"missing inputs {missing}; the module takes {self.input_names}")
        arguments = {}
        for name in self.input_names:
            value, resident = feed[name], self._resident.get(name)
            if resident is not None and resident[0] is value:
                arguments[name] = resident[1]
            elif name in self.in_place:  # the step writes into it: a device copy, never the caller's array
                arguments[name] = self._rt.asdevicearray(self._config.device, np.array(value, order="C"))
            else:
                arguments[name] = np.asarray(value, order="C")
        results = self._function(*arguments.values())
        if len(self.output_names) == 1:
            results = (results,)
        outputs, self._resident = {}, {}
        returned = zip(self.output_names, results, strict=True)
        overwritten = ((updated_name(name), arguments[name]) for name in self.in_place)
        for name, value in [*returned, *overwritten]:
            outputs[name] = value.to_host()
            if name.startswith(UPDATED_PREFIX) and getattr(value, "_is_mappable", lambda: False)():
                self._resident[strip_prefix(name, UPDATED_PREFIX)] = (outputs[name], value)  # a view, not a copy
        return outputs


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
