"""Run training steps of a training graph compiled by onnx-mlir (a model ``.so``, ``bridge.compile``).

``OnnxMlirTrainingSession`` has the interface of the onnxruntime ``TrainingSession`` (same inputs,
``updated_*`` fed back, ``.state``, ``.lr``, Dropout noise drawn each step), so one training loop
can use any backend. onnx-mlir's Python runtime (``PyRuntime.OMExecutionSession``, in the install's
``lib/``) takes the graph inputs positionally, in graph order; the library's signature names them.
``find_onnx_mlir`` locates the compiler and runtime (``ONNX_MLIR_HOME``, else ``PATH``).

A graph compiled in pieces (``bridge.compile(..., pieces=)``) is one zip archive (``pack_pieces``): each
piece's ``.so`` and ``pieces.json``, the order and the graph's input and output names; the session runs
the pieces in that order, each fed the graph inputs and earlier pieces' outputs it reads. A module compiled
with ``in_place=True`` (the manifest says so) has the session release each state array it holds once the
last piece that reads it has run: the new state of each piece takes the memory of the old state it replaces,
instead of the whole new state sitting beside the whole old one at the step's end.
"""
from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from ..contract import DIM_BOUNDS, decode_random_inputs, props, updated_name
from ..errors import InvalidOptionError, MissingExtraError, ModelLoadError
from .piecewise import LoadedPiece, PiecewiseStep
from .runtime import SessionGraph, StepSession, compiled_identity, compiled_module

if TYPE_CHECKING:
    from ..tools.compile import CompiledModel

HOME = "ONNX_MLIR_HOME"
# What onnx-mlir --EmitLib runs after its own passes (paths fixed in the Debian LLVM 22 build it was made with).
LLVM_TOOLS = (Path("/usr/lib/llvm-22/bin/opt"), Path("/usr/lib/llvm-22/bin/llc"), Path("/usr/bin/clang++-22"))
INSTALL_HINT = (
    "set ONNX_MLIR_HOME to an onnx-mlir install (bin/onnx-mlir, lib/PyRuntime*) or put onnx-mlir on PATH; get one "
    "from onnx-mlir's docker image (ghcr.io/onnxmlir/onnx-mlir) or build it with the recipe in shared/onnx-mlir/build; "
    "it needs Debian's packages libllvm22 libprotobuf32 llvm-22 clang-22 (apt-get install, or make system-deps)"
)


_MANIFEST = "pieces.json"
# glibc mallopt parameters: blocks up to the largest mmap threshold glibc accepts come from the heap, and the
# heap is never trimmed (both constants are glibc's <malloc.h> values)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCKS_UP_TO = 32 * 2**20
_NEVER_TRIM = 2**31 - 1  # mallopt takes a C int


def pack_pieces(libraries: list[bytes], inputs: list[str], outputs: list[str], in_place: bool = False) -> bytes:
    """One zip archive of the pieces' libraries (run in list order), the graph's ``inputs``/``outputs`` and
    whether its sessions release the state as the pieces run (``in_place``)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        names = [f"piece{index}.so" for index in range(len(libraries))]
        for name, library in zip(names, libraries, strict=True):
            archive.writestr(name, library)
        archive.writestr(_MANIFEST, json.dumps({"pieces": names, "inputs": inputs, "outputs": outputs,
                                                "in_place": in_place}))
    return buffer.getvalue()


def is_pieces_archive(module: bytes) -> bool:
    """Whether ``module`` is a graph compiled in pieces (``pack_pieces``), not one ``.so``."""
    return module[:4] == b"PK\x03\x04"


class OnnxMlirNotFoundError(MissingExtraError):
    """onnx-mlir, its Python runtime or the LLVM tools it calls are missing; the message says what to install."""


@dataclass(frozen=True)
class OnnxMlir:
    """An onnx-mlir install: the compiler driver and the folder holding ``libcruntime.a`` and ``PyRuntime``."""

    compiler: Path
    lib: Path


def find_onnx_mlir(compiling: bool = True) -> OnnxMlir:
    """The onnx-mlir install named by ``ONNX_MLIR_HOME``, else the ``onnx-mlir`` on ``PATH`` (its lib:
    ``<bin>/../lib``). ``compiling``: also check the LLVM tools ``--EmitLib`` calls (opt, llc, clang++).
    Raises ``OnnxMlirNotFoundError`` naming what is missing and what to install."""
    home = os.environ.get(HOME)
    if home:
        compiler, where = Path(home) / "bin" / "onnx-mlir", f"{HOME}={home}"
    else:
        found = shutil.which("onnx-mlir")
        if found is None:
            raise OnnxMlirNotFoundError(f"onnx-mlir was not found (no {HOME}, none on PATH): {INSTALL_HINT}")
        compiler, where = Path(found).resolve(), "PATH"
    lib = compiler.parent.parent / "lib"
    missing = [] if compiler.is_file() else [str(compiler)]
    if not list(lib.glob("PyRuntime*.py")):
        missing.append(f"{lib}/PyRuntime.py")
    if compiling:
        missing += [str(tool) for tool in LLVM_TOOLS if not tool.is_file()]
    if missing:
        raise OnnxMlirNotFoundError(f"onnx-mlir ({where}) is incomplete, missing {', '.join(missing)}: {INSTALL_HINT}")
    return OnnxMlir(compiler, lib)


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed blocks for reuse (no ``mmap`` per block up to 32 MiB, no heap trimming);
    False where the C library has no ``mallopt`` (not glibc).

    An onnx-mlir library mallocs each op's result and frees it within the step. Under glibc's defaults a
    large block is a fresh ``mmap``, and a freed heap top is returned to the kernel, so every step
    page-faults its buffers anew and the kernel zeroes them: im2col copies (Slice, Concat) then take
    several times their copying time. Kept, the next step reuses the same pages. The setting is per
    process; the process keeps its high-water mark of freed memory. A process that tunes malloc through
    the environment (``MALLOC_*_`` variables, ``glibc.malloc`` tunables: benchmarks/step_memory.py does,
    so that RSS follows live memory) keeps its own settings: False, nothing set."""
    if any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ) or \
            "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UP_TO)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))


def _execution_session_class():
    """``PyRuntime.OMExecutionSession`` of the install that ``find_onnx_mlir`` finds."""
    lib = str(find_onnx_mlir(compiling=False).lib)
    if lib not in sys.path:
        sys.path.append(lib)
    try:
        from PyRuntime import OMExecutionSession
    except ImportError as exc:
        raise OnnxMlirNotFoundError(f"onnx-mlir's Python runtime in {lib} does not load ({exc}): {INSTALL_HINT}") from exc
    return OMExecutionSession


class OnnxMlirTrainingSession(StepSession):
    """Train with a model library compiled by onnx-mlir: ``session.step(inputs, target)`` -> outputs."""

    def __init__(self, library: CompiledModel | bytes | str | os.PathLike, state: Mapping[str, np.ndarray],
                 seed: int | None = None, *, training_model: onnx.ModelProto | None = None,
                 eval_model: onnx.ModelProto | None = None, eval_library: bytes | None = None,
                 on_nonfinite: str = "raise"):
        """``library``: a ``CompiledModel``, the bytes of a ``.so`` or its path. ``training_model``, the ONNX
        graph the library was compiled from (a ``CompiledModel`` carries it), gives the Dropout noise inputs
        and the batch checks, and makes checkpoints interchangeable with the other backends' sessions of
        that graph (same hash); ``eval_model`` enables ``evaluate`` on this state, run by ``eval_library``
        (``eval_model`` compiled by onnx-mlir) when given, else in onnxruntime."""
        training_model = getattr(library, "graph", None) if training_model is None else training_model
        library = getattr(library, "module", library)  # a bridge.tools.compile.CompiledModel
        library, source = compiled_module(library, "compiled model library")
        super().__init__(state, seed, on_nonfinite=on_nonfinite, eval_model=eval_model,
                         **compiled_identity(library, training_model))
        self._folder = tempfile.TemporaryDirectory(prefix="bridge-onnx-mlir-")  # lives as long as the session
        keep_freed_memory()
        self._pieces, self.input_names, self.output_names, in_place = _load_pieces(library, Path(self._folder.name), source)
        if in_place:
            self._set_in_place([name for name in self.input_names if updated_name(name) in self.output_names])
        self._step = PiecewiseStep(self._pieces, self.output_names, self.in_place, _run_piece,
                                   "bridge.compile(in_place=True)")
        if training_model is not None:
            meta = props(training_model.metadata_props)
            for name in decode_random_inputs(meta):
                shape, dtype = self.checks.specs[name]
                self.random_inputs[name] = ([None if d == "?" else d for d in shape], dtype)
            self.dim_bounds = json.loads(meta.get(DIM_BOUNDS, "{}"))
        if eval_library is not None and self.eval_graph is not None:
            self.eval_graph.graph = OnnxMlirGraph(eval_library, eval_model)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [name for name in self.input_names if name not in feed]
        if missing:
            hint = "" if self.checks is not None else " (noise inputs are drawn only with training_model=, the ONNX graph)"
            raise InvalidOptionError(f"missing inputs {missing}; the library takes {self.input_names}{hint}")
        return self._step(feed, self.state)


def _run_piece(piece: LoadedPiece, values: dict[str, np.ndarray]) -> list[np.ndarray]:
    # arrays of the graph's ranks (the runtime refuses a 1-element 1-d step or lr; ascontiguousarray would make one)
    return piece.session.run([np.asarray(values[name], order="C") for name in piece.input_names])


def _load_pieces(module: bytes, folder: Path, source: str) -> tuple[list[LoadedPiece], list[str], list[str], bool]:
    """The libraries of ``module`` (one ``.so`` or a ``pack_pieces`` archive, read from ``source``), written
    to ``folder`` and loaded, with the graph's input and output names and the archive's ``in_place``."""
    session_class = _execution_session_class()
    try:
        if is_pieces_archive(module):
            with zipfile.ZipFile(io.BytesIO(module)) as archive:
                manifest = json.loads(archive.read(_MANIFEST))
                archive.extractall(folder, members=manifest["pieces"])
            paths = [folder / name for name in manifest["pieces"]]
        else:
            manifest, paths = None, [folder / "model.so"]
            paths[0].write_bytes(module)
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{source} is not a model compiled by onnx-mlir in pieces: {exc}") from exc
    pieces = []
    for path in paths:
        try:
            session = session_class(str(path), tag="NONE")  # the untagged entry points: any file name
            pieces.append(LoadedPiece(session, [v["name"] for v in json.loads(session.input_signature())],
                                       [v["name"] for v in json.loads(session.output_signature())]))
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{source} ({path.name}) is not a model library compiled by onnx-mlir: {exc}") from exc
    if manifest is None:
        return pieces, pieces[0].input_names, pieces[0].output_names, False
    return pieces, manifest["inputs"], manifest["outputs"], bool(manifest.get("in_place", False))


class OnnxMlirGraph(SessionGraph):
    """A compiled graph (``library``, compiled from ``model``) called like ``bridge.training.runtime.OrtGraph``."""

    def __init__(self, library: bytes, model: onnx.ModelProto):
        super().__init__(OnnxMlirTrainingSession(library, {}, training_model=model))
