"""The onnxruntime-training backend of benchmarks/run.py, run by the python of its own venv
(``--ort-training-python``; onnxruntime-training 1.19.2 needs onnx <= 1.16 and torch, so it cannot
share bridge's environment). It imports neither bridge nor the benchmark models.

    <python> ort_training_child.py MODEL.onnx INPUTS.npz WORKDIR THREADS LR PARAM [PARAM ...]

MODEL.onnx is the benchmark model exported in training mode (BatchNorm with batch statistics);
``generate_artifacts`` adds onnxruntime's cross-entropy loss, its gradient graph (com.microsoft
fused gradient kernels) and its AdamW optimizer graph for the PARAMs. INPUTS.npz holds the model
inputs and ``target``. The child prints ``ready``, then for every ``step`` line on stdin runs one
``Module.train_step`` + ``Optimizer.step`` + ``lazy_reset_grad`` and prints that step's wall time
in seconds (so the parent's pipe round trip is not counted); it exits at end of input.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module, Optimizer


def main(argv: list[str]) -> int:
    model_path, inputs_path, workdir, threads, lr, *params = argv
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(onnx.load(model_path), requires_grad=params, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=str(out))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = int(threads)
    state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
    # no eval model: onnxruntime 1.19.2 cannot load the one it generates for a training-mode BatchNorm
    module = Module(str(out / "training_model.onnx"), state, None, "cpu", session_options=options)
    optimizer = Optimizer(str(out / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(float(lr))
    module.train()
    data = np.load(inputs_path)
    feed = [data[name] for name in module.input_names()[:-1]] + [data["target"]]
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            continue
        start = time.perf_counter()
        module(*feed)
        optimizer.step()
        module.lazy_reset_grad()
        print(time.perf_counter() - start, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
