"""IREE 3.13 overwrites an argument updated in place before a later read of its old value has run.

    python tests/repros/iree_in_place_read_after_write.py [out.onnx]

builds the smallest form of a weight's role in a training step: ``w`` [512, 512] is read by a MatMul
(``y = x @ w``, as the backward's ``dX = dY @ W`` reads a weight) and updated (``updated_w = w - lr * g``), the
update not depending on the MatMul. The graph is imported as bridge.compile imports it, once returning
``updated_w`` in a new buffer and once with ``w`` updated in place (``bridge.tools.compile.to_mlir``'s
``in_place``: torch's mutable-tensor form, ``torch.copy.to_vtensor`` then ``torch.overwrite.tensor.contents``,
which IREE lowers to ``hal.tensor.alias`` of the result onto the argument's buffer), and compiled with IREE
(bridge.compile's flags, llvm-cpu, host CPU). The script prints, for each, how far ``y`` is from ``x @ w`` with
the old ``w`` and with the updated one (numpy, float64).

With the new buffer ``y`` is ``x @ old w``. In place, IREE runs the update while the MatMul still reads ``w``
and writes ``updated_w`` into that buffer: ``y`` is far from both products (it read a ``w`` partly updated).
IREE orders dispatches by their data only and does not count the readers of the aliased argument, so bridge
updates in place only the state whose every reader the update depends on
(``bridge.tools.compile.in_place_state``). ``out.onnx``: the graph is written.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SIZE = 512
LR = 0.5


def build() -> onnx.ModelProto:
    """``y = x @ w`` and ``updated_w = w - lr * g``: one weight read after its update is computable."""
    square = [SIZE, SIZE]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, square) for name in ("w", "x", "g")]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, square) for name in ("y", "updated_w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("Mul", ["g", "lr"], ["step"]),
             helper.make_node("Sub", ["w", "step"], ["updated_w"])]
    graph = helper.make_graph(nodes, "read_after_update", inputs, outputs,
                              [helper.make_tensor("lr", TensorProto.FLOAT, [], [LR])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def main() -> None:
    import iree.compiler.tools as iree_tools
    import iree.runtime as rt

    from bridge.tools.compile import _IREE_FLAGS, to_mlir

    model = build()
    onnx.checker.check_model(model, full_check=True)
    if len(sys.argv) > 1:
        onnx.save(model, sys.argv[1])
    rng = np.random.default_rng(0)
    w, x, g = (rng.standard_normal((SIZE, SIZE)).astype(np.float32) for _ in range(3))
    old = x.astype(np.float64) @ w.astype(np.float64)
    new = x.astype(np.float64) @ (w - np.float32(LR) * g).astype(np.float64)
    for in_place in ((), ("w",)):
        vmfb = iree_tools.compile_str(to_mlir(model, in_place), input_type="onnx", target_backends=["llvm-cpu"],
                                      extra_args=[*_IREE_FLAGS, "--iree-llvmcpu-target-cpu=host"])
        config = rt.Config("local-task")
        function = rt.load_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb), config).read_after_update
        w_buffer = rt.asdevicearray(config.device, w.copy())
        results = function(w_buffer, x, g)
        y = (results[0] if isinstance(results, (list, tuple)) else results).to_host()
        form = "in place  " if in_place else "new buffer"
        print(f"{form}: |y - x @ old w| max {np.max(np.abs(y - old)):.3g}, |y - x @ updated w| max "
              f"{np.max(np.abs(y - new)):.3g}; w's buffer {'updated' if not np.array_equal(w_buffer.to_host(), w) else 'unchanged'}")


if __name__ == "__main__":
    main()
