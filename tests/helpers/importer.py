"""bridge's importer, evaluated eagerly, against onnxruntime: the check of ONNX forward semantics
(one copy, used by the op, op-database, conv/pool, resize, normalization and zoo-op tests)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
import torch

from bridge.pipeline.importer.program import OnnxProgram
from bridge.pipeline.load import load_model


def run_onnxruntime(model: onnx.ModelProto, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The inference model itself in onnxruntime: the reference for ONNX forward semantics."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(feed))


def import_and_run(model: onnx.ModelProto | str, feed: Mapping[str, np.ndarray], training: bool = False,
                   checked: bool = True) -> list[np.ndarray]:
    """Every output of ``model`` as bridge's importer computes it (torch ops, eagerly), after
    bridge's loader (the ONNX checker, function inlining); ``checked=False`` skips the loader, for
    test models the checker refuses (outputs declared without a shape)."""
    program = OnnxProgram(load_model(model) if checked else model)
    inputs = {k: torch.as_tensor(np.asarray(v)) for k, v in feed.items()}
    tensors = {n: program.initializer_tensor(n) for n in program.initializers}
    outputs, _ = program.run(inputs, tensors, training=training)
    return [o.detach().numpy() for o in outputs]


def importer_and_onnxruntime(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], training: bool = False,
                             checked: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """(bridge, onnxruntime) per output, after checking that both give the same outputs and shapes."""
    got, want = import_and_run(model, feed, training, checked), run_onnxruntime(model, feed)
    assert len(got) == len(want), f"{len(got)} outputs, onnxruntime {len(want)}"
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"output {index}: shape {g.shape} != onnxruntime's {w.shape}"
    return list(zip(got, want, strict=True))


def assert_importer_matches_onnxruntime(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], rtol: float,
                                        atol: float, training: bool = False, checked: bool = True,
                                        what: str = "") -> None:
    """Every output of bridge's importer equals onnxruntime's within ``rtol``/``atol``."""
    for index, (got, want) in enumerate(importer_and_onnxruntime(model, feed, training, checked)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{what} output {index}")
