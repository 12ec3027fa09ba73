"""Zoo models converted for onnx-mlir (``target="onnx-mlir"``) compile in onnx-mlir at its default flags
(``--EmitLib -O3``) and train like onnxruntime.

The models and their conversions are tests/test_iree_zoo.py's (hand-built, text, vision, torchvision;
static and symbolic batch, Adam): onnx-mlir's first step (loss, every gradient, every update) is
compared with onnxruntime's at one thread (onnx-mlir runs on one) at the zoo's tolerance (twice torch's
float32 noise on top of the case's rtol, ``zoo.harness.assert_first_step``); where a torch module's data
sits at float32 decisions, each runtime is compared with torch float64 up to proven near-decision flips
instead, as the IREE zoo test does. ``bridge.compile`` compiles a graph of more than about
``NODES_PER_PIECE`` nodes in pieces (bigru_regressor's 2 pieces in ``make test``, a torch CNN's 5-8).

Tiers by measured compile time: ``make test`` runs ``DEFAULT``, the models whose onnx-mlir compile takes
a few CPU seconds (the hand-built CNNs and bidirectional GRU, an MLP, a LayerNorm + Gelu block, a
2-layer transformer); the torch CNNs, whose compiles take one to several CPU minutes even in pieces, and
the rest are ``exhaustive``. tests/onnx_mlir_zoo_results.json records each run's figures and
docs/onnx_mlir_zoo.py renders the table of docs/models.md from them.
"""
from __future__ import annotations

import os
import resource
import time
import warnings
from dataclasses import replace

import pytest
from zoo.compiled import median_step_seconds, torch_case, zoo_params

import bridge
from bridge.tools.target_check import onnx_mlir_missing

_MISSING = onnx_mlir_missing()
pytestmark = [pytest.mark.onnx_mlir,
              pytest.mark.skipif(_MISSING is not None, reason=f"onnx-mlir is not available: {_MISSING}")]

# compiles of a few CPU seconds each (tests/onnx_mlir_zoo_results.json)
DEFAULT = {"matmul_add_mlp-static", "layernorm_gelu-static", "distilbert-static", "bigru_regressor-static",
           "conv1d-static", "conv3d-static", "conv_transpose_decoder-static", "average_pool_pads-static",
           "depthwise_dilated-static", "odd_sizes_floor-static", "resize_upsampling-static"}
# param id -> the onnx-mlir defect it hits and its repro (strict: a fixed defect fails the xfail)
XFAIL: dict[str, str] = {}


def _params():
    for param in zoo_params():
        marks = [pytest.mark.slow] + ([] if param.id in DEFAULT else [pytest.mark.exhaustive])
        if param.id in XFAIL:
            marks.append(pytest.mark.xfail(reason=XFAIL[param.id], strict=True))
        yield pytest.param(*param.values, marks=marks, id=param.id)


def test_default_models_are_zoo_models():
    ids = {param.id for param in zoo_params()}
    assert DEFAULT <= ids and set(XFAIL) <= ids


@pytest.mark.parametrize("kind, name, mode", list(_params()))
def test_zoo_model_matches_onnxruntime_in_onnx_mlir(kind, name, mode, tmp_path, request):
    """onnx-mlir's first step against onnxruntime's (one thread) at the zoo's tolerance; for a torch
    module where that fails, each runtime against torch float64 up to proven near-decision flips."""
    from zoo.handbuilt import CASES
    from zoo.harness import assert_first_step, assert_float64_up_to_flips

    if kind == "handbuilt":
        case = next(b for b in CASES if b.__name__ == name)()
        tm = bridge.to_training_onnx(case.model, loss=case.loss, optim="adam", optim_options={"lr": case.lr},
                                     input_shapes={k: list(v.shape) for k, v in case.inputs.items()}, target="onnx-mlir")
        expected = None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case, tm, fit = torch_case(kind, name, mode, tmp_path, convert_for="onnx-mlir")
        expected = case.oracle()
    start, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    compiled = bridge.compile(tm, backend="onnx-mlir")
    compile_seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    compile_cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    onnx_mlir, ort = compiled.session(seed=0), tm.session(seed=0, threads=1)
    got, want = onnx_mlir.step(case.inputs, case.target), ort.step(case.inputs, case.target)
    noise = {k: 2 * v for k, v in expected[1].items()} if expected is not None else {}
    if expected is not None:  # the zoo's keys
        want = {k: want[k] for k in expected[0]}
    try:
        assert_first_step(replace(case, name=f"{case.name} onnx-mlir vs onnxruntime"), got, want, noise, tm.initial_state())
    except AssertionError as direct:
        if expected is None:
            raise
        for runtime, step in (("onnx-mlir", got), ("onnxruntime", want)):
            assert_float64_up_to_flips(case, runtime, step, fit(step, *expected), expected[1], tm.initial_state(), direct)
    print(f"\nONNX-MLIR-ZOO {request.node.callspec.id}: {len(tm.model.graph.node)} nodes, compile {compile_seconds:.1f} s "
          f"wall, {compile_cpu:.1f} s CPU (load {os.getloadavg()[0]:.1f}), "
          f"step onnx-mlir {median_step_seconds(onnx_mlir, case.inputs, case.target) * 1e3:.1f} ms, "
          f"onnxruntime {median_step_seconds(ort, case.inputs, case.target) * 1e3:.1f} ms")
