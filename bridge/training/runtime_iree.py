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
step's in the same memory: copy what must outlive the next step. Such a module holds the step as
functions the session calls in turn (``PIECE``), each value one makes passed to the next as IREE's buffer.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from ..contract import (
    GRAD_PREFIX,
    IN_PLACE,
    INPUT_SPECS,
    INPUTS,
    OUTPUTS,
    PIECE,
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
        self._call = _DirectCall(rt, vm_module, self._config)
        self._calls: list[tuple[Any, list[str], list[str], list[str]]] = []  # function, inputs, outputs, in place
        for entry in _entry_functions(vm_module):
            function = vm_module.lookup_function(entry)
            reflection = function.reflection
            self._calls.append((function, json.loads(reflection[INPUTS]), json.loads(reflection[OUTPUTS]),
                                json.loads(reflection.get(IN_PLACE, "[]"))))
        step = json.loads(reflection.get(PIECE, "{}"))  # a step in several calls: its own names
        self.input_names = step.get("inputs", self._calls[0][1])
        self.output_names = step.get("outputs", self._calls[0][2])
        self._set_in_place([name for call in self._calls for name in call[3]])
        specs = json.loads(reflection.get(INPUT_SPECS, "{}"))
        for name in decode_random_inputs(reflection):
            shape, dtype = specs[name]
            self.random_inputs[name] = (shape, np.dtype(dtype))
        self._resident: dict[str, tuple[np.ndarray, object]] = {}  # state name -> (host view, its buffer view)

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
                arguments[name] = self._call.to_device(value)
            else:
                arguments[name] = np.asarray(value, order="C")
        values: dict[str, Any] = dict(arguments)
        for function, reads, makes, overwrites in self._calls:
            values.update(zip(makes, self._call(function, [values[name] for name in reads], len(makes)), strict=True))
            values.update((updated_name(name), values[name]) for name in overwrites)
        outputs, self._resident = {}, {}
        for name in [*self.output_names, *(updated_name(name) for name in self.in_place)]:
            result = values[name]
            outputs[name] = self._call.to_host(result)
            if not name.startswith((UPDATED_PREFIX, GRAD_PREFIX)):
                # a view of the loss would keep the result allocation it shares (a step in two calls: every
                # gradient) alive for as long as the caller keeps the outputs
                outputs[name] = outputs[name].copy()
            if name.startswith(UPDATED_PREFIX):
                self._resident[strip_prefix(name, UPDATED_PREFIX)] = (outputs[name], result)  # a view, not a copy
        return outputs


class _DirectCall:
    """Calls a module's functions through IREE's VM directly: the arguments (host arrays, device arrays, buffer
    views) packed by the packer IREE's ``FunctionInvoker`` uses, the results given back as buffer views, each
    mapped to a host array where asked, instead of ``FunctionInvoker``'s wrapping and decoding of each result in
    Python, a fixed cost per result of every step (tests/repros/iree_call_overhead.py)."""

    def __init__(self, rt, vm_module, config):
        from iree.runtime._binding import ArgumentPacker, InvokeContext, _invoke_statics  # the pinned release's

        self._rt, self._device, self._invoke_context = rt, config.device, InvokeContext
        self._context = rt.SystemContext(vm_modules=[vm_module], config=config).vm_context
        self._packer = ArgumentPacker(_invoke_statics, None)  # no ABI descriptions: arguments as they come

    def __call__(self, function, arguments: list, count: int) -> list:
        """``function``'s ``count`` results, as buffer views."""
        returned = self._rt.VmVariantList(count)
        self._context.invoke(function, self._packer.pack(self._invoke_context(self._device), arguments, {}), returned)
        return [returned.get_as_object(index, self._rt.HalBufferView) for index in range(len(returned))]

    def to_device(self, array: np.ndarray):
        """A copy of ``array`` in a new buffer of the device, as a buffer view."""
        array = np.asarray(array, order="C")
        return self._device.allocator.allocate_buffer_copy(
            memory_type=self._rt.MemoryType.DEVICE_LOCAL, allowed_usage=self._rt.BufferUsage.DEFAULT,
            device=self._device, buffer=array, element_type=self._rt.dtypes.map_dtype_to_hal_element_type(array.dtype))

    def to_host(self, view) -> np.ndarray:
        """A result as a host array: a view of its buffer (modules run on the CPU, whose memory the host maps)."""
        return view.map().asarray(view.shape, self._rt.HalElementType.map_to_dtype(view.element_type))


def _entry_functions(vm_module) -> list[str]:
    """The (synchronous) functions that ``bridge.compile`` tagged with their input names, in run order
    (``PIECE``: a step in several calls)."""
    tagged = []
    for name in vm_module.function_names:
        if "$" in name:  # IREE's generated variants (``<name>$async`` takes fences)
            continue
        function = vm_module.lookup_function(name)
        if function is not None and INPUTS in function.reflection:
            tagged.append((json.loads(function.reflection.get(PIECE, "{}")).get("index", 0), name))
    if not tagged:
        raise ModelLoadError("the module was not compiled by bridge.compile (no function lists its inputs)")
    return [name for _, name in sorted(tagged)]


def _entry_function(vm_module) -> str:
    """The first function a step calls (``_entry_functions``)."""
    return _entry_functions(vm_module)[0]


class IreeGraph(SessionGraph):
    """A compiled graph (``module``, compiled from ``model``) called like ``bridge.training.runtime.OrtGraph``."""

    def __init__(self, module: bytes, model: onnx.ModelProto):
        super().__init__(IreeTrainingSession(module, {}, training_model=model))
