"""IREE 3.13 defect, avoided, cause not found (not minimal): the zoo's resnet18 at batch 2 got wrong gradients.

It reproduces with bridge at commit 6df5bb6 (Conv backward as transposed/zero-inserted Convs, max-pool
backward scattered by a one-hot grouped Conv). With the GEMM and scatter forms that replaced them
(bridge/pipeline/lowering/conv.py), IREE computes this model's step right (tests/test_iree_zoo.py
``resnet18-static`` passes), so run this script from a checkout of 6df5bb6.

    python tests/repros/iree_resnet18_relu_where.py      # ~10 minutes of one core

converts tests/zoo's resnet18 (torchvision, perturbed, 64x64, batch 2, Adam + cross entropy,
static batch), makes every float tensor of layer2's and layer3.0's nodes a graph output,
compiles with bridge.compile (IREE llvm-cpu, default flags), runs the first step's graph in IREE
and onnxruntime on the same feed and prints each tensor's largest difference (of its scale),
flagging those over 1e-4.

Measured: the first wrong tensor is layer2.0's output-ReLU backward
``Where(LessOrEqual(relu_out, 0), 0, g)``, 19% of its scale off, while ``relu_out`` (1.7e-6)
and ``g`` (1.3e-5) match onnxruntime; everything computed from it is off (every gradient from
layer2.0 upstream, 0.6-8.6%; onnxruntime and torch float64 agree to 1e-5). Deterministic: the
same numbers with the local-task and local-sync drivers and with ``FAST_CONV_FLAGS``. No
pre-ReLU value is near a tie (smallest |value| 3.9e-5 of scale 10.2, float32 error ~1.7e-6), so
it is not a float32 ReLU decision flipping. Nor the boolean Where: with every ReLU backward rewritten
as ``Mul(g, Sign(relu_out))`` the gradients are wrong by exactly the same amounts. Not reproduced in isolation: torchvision's layer2
alone (with a 1x1 Conv in front, batch 2, the same shapes), one Conv's input gradient and the
resnet stem are exact. resnet18 at batch 8 (32x32, 64x64) passes.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bridge  # noqa: E402
from bridge.training.runtime_iree import IreeTrainingSession  # noqa: E402

LAYERS = ("/layer2/", "/layer3/layer3.0/")


def _probe_outputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with every float tensor of the nodes under ``LAYERS`` added as an output."""
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v for v in model.graph.value_info}
    probes = [o for n in model.graph.node if any(layer in n.name for layer in LAYERS) for o in n.output
              if o in types and types[o].type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    model.graph.output.extend(types[o] for o in probes)
    return model, probes


def main() -> None:
    from test_iree_zoo import _torch_case

    with TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case, tm = _torch_case("vision", "resnet18", "static", Path(tmp))
    session, feed = tm.session(seed=0), {}
    run = session._run
    session._run = lambda f: (feed.update(f), run(f))[1]  # the exact feed of the first step
    session.step(case.inputs, case.target)
    model, probes = _probe_outputs(tm.model)
    feed = {i.name: feed[i.name] for i in model.graph.input}
    names = [o.name for o in model.graph.output]
    want = dict(zip(names, ort.InferenceSession(model.SerializeToString(),
                                                providers=["CPUExecutionProvider"]).run(None, feed), strict=True))
    got = IreeTrainingSession(bridge.compile(model).vmfb, {})._run(feed)
    producer = {o: n for n in model.graph.node for o in n.output}
    for name in probes:
        error = float(np.max(np.abs(got[name] - want[name])) / (np.max(np.abs(want[name])) + 1e-30))
        print(f"{'BAD' if error > 1e-4 else 'ok '} {error:.1e} {producer[name].name}", flush=True)


if __name__ == "__main__":
    main()
