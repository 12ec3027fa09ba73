"""The ways a torch model becomes ONNX, as real users export it.

``legacy<opset>`` is ``torch.onnx.export(dynamo=False)`` without constant folding;
``legacy<opset>_functions`` exports each Linear, LayerNorm and Conv2d as a model-local ONNX
function (bridge inlines them);
``legacy<opset>_fold`` uses constant folding (models with BatchNorm are then exported in training mode:
eval-mode folding fuses BatchNorm into the preceding Conv, after which its weights no longer
exist to be trained). ``dynamo<opset>`` is the dynamo exporter. ``external`` re-saves an
export with every tensor in an external data file. ``dynamo<opset>_noopt`` skips the dynamo
exporter's ONNX optimizer, which folds lookups of constant rows (BERT's position and
token-type embeddings) into new constants: those weights are then gone from the file.
``dynamic_batch=True`` exports dim 0 of every input and of the output as the symbol ``batch``
(legacy: ``dynamic_axes``; dynamo: a ``torch.export.Dim``).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

LEGACY = {"legacy11": (11, False), "legacy13": (13, False), "legacy13_fold": (13, True), "legacy17": (17, False),
          "legacy17_fold": (17, True), "legacy17_functions": (17, False)}
FUNCTION_MODULES = {torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Conv2d}
SYMBOLIC_BATCH = "legacy17"  # the zoo's export with a symbolic batch (tests/test_zoo_vision.py)
DYNAMO = {"dynamo18": (18, True), "dynamo20": (20, True), "dynamo18_noopt": (18, False), "dynamo20_noopt": (20, False)}


def has_batchnorm(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a BatchNorm layer."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())


def export(module: torch.nn.Module, inputs: dict[str, np.ndarray], how: str, path: Path, external: bool = False,
           dynamic_batch: bool = False) -> str:
    """Export ``module`` (called with ``inputs`` in order) to ``path`` with exporter ``how``
    (with a symbolic batch dim named ``batch`` when ``dynamic_batch``)."""
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    names = list(inputs)
    axes = {name: {0: "batch"} for name in [*names, "y"]} if dynamic_batch else None
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how in LEGACY:
            opset, fold = LEGACY[how]
            mode = torch.onnx.TrainingMode.TRAINING if fold and has_batchnorm(module) else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=opset, do_constant_folding=fold,
                              training=mode, input_names=names, output_names=["y"], dynamic_axes=axes,
                              export_modules_as_functions=FUNCTION_MODULES if how.endswith("_functions") else False)
        elif how in DYNAMO:
            opset, optimize = DYNAMO[how]
            batch = torch.export.Dim("batch") if dynamic_batch else None
            shapes = tuple({0: batch} for _ in names) if dynamic_batch else None
            torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset, optimize=optimize,
                              input_names=names, output_names=["y"], dynamic_shapes=shapes, verbose=False)
        else:
            raise ValueError(f"unknown exporter {how}")
    module.eval()
    if external:
        model = onnx.load(str(path))
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=Path(path).name + ".data", size_threshold=0)
    return str(path)
