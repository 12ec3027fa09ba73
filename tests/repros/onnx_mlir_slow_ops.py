"""onnx-mlir limits on a transformer's training step: its MatMul/Gemm and its Tanh, Erf and Exp are slow.

    python tests/repros/onnx_mlir_slow_ops.py [out_folder]

builds one-op graphs at the sizes of bert_tiny's and gpt2_tiny's steps (benchmarks/models.py: 256 tokens,
width 128, MLP width 512, vocabulary 1000), compiles each with ``onnx-mlir --EmitLib -O3`` as it is, for
onnx-mlir's default CPU and with ``--mcpu=native`` (as benchmarks/run.py compiles), and times it against onnxruntime at one thread (the fastest of ``REPEATS`` calls after one warm-up, each
call's CPU time, so that other processes on the machine do not count); ``out_folder`` keeps the files.

- ``Gemm`` and ``MatMul`` (the Linear layers forward and backward, and the vocabulary's logits): at onnx-mlir's
  default CPU its tiled loops run at a quarter to a third of onnxruntime's MLAS kernels, whichever form the
  product takes (``transA``, ``transB``, a pre-transposed operand, ``MatMul`` + ``Add``). With ``--mcpu=native``
  a product with an inner dimension of 128 (these models' width) still takes 2-4x onnxruntime's time in every
  form: no form bridge can emit reaches onnxruntime there. onnx-mlir's ``Gemm`` runs fast at an inner
  dimension of 256 (the same product with its inner dimension zero-padded to 256, twice the multiply-adds, runs
  faster than the 128 one) and less so between multiples of 256. These products are most of the models' step
  time. Of onnx-mlir's own forms, a product with a long inner dimension runs faster as a ``Gemm`` than as a ``MatMul``
  (the input gradient below, in both forms: near onnxruntime's time as a ``Gemm`` with ``--mcpu=native``),
  slower where the inner dimension is short: the ``onnx-mlir`` target emits the faster one (``long_inner_gemm``,
  bridge/pipeline/targets.py).
- A ``Gemm`` that reads its first operand transposed (``transA``: the Linear weight gradient), or its second
  (``transB``) at a short inner dimension (GPT-2's logits, a Linear of 128 inputs), runs slower than a
  ``Transpose`` of that operand and the plain product together (with ``--mcpu=native``): the ``onnx-mlir``
  target emits the latter (``explicit_transposes``).
- ``Exp`` (the cross-entropy's softmax over GPT-2's vocabulary) runs element by element at several times
  onnxruntime's time, with or without ``--mcpu``: no exact form avoids it.
- ``Tanh`` (GPT-2's tanh GELU, which onnx-mlir recomposes into ``Gelu``) calls the C library's ``tanhf``
  element by element: tens of times onnxruntime's. bridge's ``onnx-mlir`` target avoids it
  (``tanh_as_exp``, bridge/pipeline/targets.py).
- ``Erf`` (BERT's GELU) is as slow as ``Tanh`` at onnx-mlir's default CPU; with ``--mcpu=native``
  (``bridge.compile(..., target_cpu="native")``) this one-op graph's Erf is vectorized.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

REPEATS = 30
CPU_FLAGS = ((), ("--mcpu=native",))  # each graph compiled for onnx-mlir's default CPU and for this machine's
CASES = {  # name -> (op, attributes, input shapes, output shape, the inputs read through a Transpose first)
    "Gemm transB (Linear forward, 256x128 @ 128x512)": ("Gemm", {"transB": 1}, [[256, 128], [512, 128]], [256, 512], ()),
    "Gemm (the same, inner dimension zero-padded to 256: twice the work)": ("Gemm", {}, [[256, 256], [256, 512]], [256, 512], ()),
    "MatMul (Linear input gradient, 256x512 @ 512x128)": ("MatMul", {}, [[256, 512], [512, 128]], [256, 128], ()),
    "Gemm (the same, long_inner_gemm)": ("Gemm", {}, [[256, 512], [512, 128]], [256, 128], ()),
    "Gemm transA (Linear weight gradient, 512x256 @ 256x128)": ("Gemm", {"transA": 1}, [[256, 512], [256, 128]], [512, 128], ()),
    "Transpose, Gemm (the same, explicit_transposes)": ("Gemm", {}, [[256, 512], [256, 128]], [512, 128], (0,)),
    "Gemm transB (logits, 256x128 @ 128x1000)": ("Gemm", {"transB": 1}, [[256, 128], [1000, 128]], [256, 1000], ()),
    "Transpose, MatMul (the same, explicit_transposes)": ("MatMul", {}, [[256, 128], [1000, 128]], [256, 1000], (1,)),
    "Tanh [256, 512]": ("Tanh", {}, [[256, 512]], [256, 512], ()),
    "Erf [256, 512]": ("Erf", {}, [[256, 512]], [256, 512], ()),
    "Exp [256, 1000] (the cross-entropy over the vocabulary)": ("Exp", {}, [[256, 1000]], [256, 1000], ()),
}


def build(op: str, attributes: dict, shapes: list[list[int]], output: list[int],
          transposed: tuple[int, ...] = ()) -> onnx.ModelProto:
    """One ``op`` node of float32 inputs of ``shapes``, those at ``transposed`` read through a 2-D Transpose."""
    names = [f"x{i}" for i in range(len(shapes))]
    operands = [f"{name}_t" if i in transposed else name for i, name in enumerate(names)]
    nodes = [helper.make_node("Transpose", [names[i]], [operands[i]], name=f"transpose{i}", perm=[1, 0]) for i in transposed]
    nodes.append(helper.make_node(op, operands, ["y"], name=op.lower(), **attributes))
    graph = helper.make_graph(nodes, op.lower(),
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes, strict=True)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, output)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def fastest_ms(call) -> float:
    """The smallest CPU time of one ``call`` over ``REPEATS`` (after one warm-up), in ms."""
    call()
    times = []
    for _ in range(REPEATS):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return 1e3 * min(times)


def compare(model: onnx.ModelProto, folder: str, flags: tuple[str, ...] = ()) -> tuple[float, float, float]:
    """onnx-mlir's (compiled with further ``flags``) and onnxruntime's time of ``model`` (ms) and the largest
    difference of their outputs relative to onnxruntime's largest magnitude."""
    import onnxruntime as ort

    from bridge.training.runtime_onnx_mlir import _execution_session_class
    from repros.onnx_mlir_defects import compile_as_is

    rng = np.random.default_rng(0)
    inputs = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
              for i in model.graph.input}
    compiled = _execution_session_class()(compile_as_is(model, folder, flags), tag="NONE")
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ours, theirs = compiled.run(list(inputs.values()))[0], session.run(None, inputs)[0]
    error = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    return fastest_ms(lambda: compiled.run(list(inputs.values()))), fastest_ms(lambda: session.run(None, inputs)), error


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repros.* when run as a script
    keep = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (op, attributes, shapes, output, transposed) in CASES.items():
        for flags in CPU_FLAGS:
            with tempfile.TemporaryDirectory() as scratch:
                folder = keep or scratch
                if keep:
                    Path(folder).mkdir(parents=True, exist_ok=True)
                    folder = tempfile.mkdtemp(prefix=op.lower() + "-", dir=keep)
                mlir_ms, ort_ms, error = compare(build(op, attributes, shapes, output, transposed), folder, flags)
            print(f"{name}, {' '.join(flags) or 'default CPU'}: onnx-mlir {mlir_ms:.3f} ms, onnxruntime {ort_ms:.3f} ms "
                  f"({mlir_ms / ort_ms:.1f}x), outputs differ by {error:.1e} of their scale")
