"""The onnxscript models of the wild tier (run inside the wild venv by build.py). onnxscript
reads the type annotations of a script function, so this module does not postpone them."""
import numpy as np
from onnx import numpy_helper
from onnxscript import FLOAT, script
from onnxscript import opset17 as op


def _with_initializers(model, weights: dict):
    """``model`` (an onnxscript function's graph) with ``weights`` moved from inputs to initializers."""
    graph = model.graph
    kept = [i for i in graph.input if i.name not in weights]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in weights.items())
    return model


def onnxscript_cnn():
    """Conv -> BatchNormalization -> Relu -> MaxPool -> GlobalAveragePool -> Flatten -> Gemm."""
    @script()
    def cnn(x: FLOAT[2, 3, 8, 8], conv_w: FLOAT[4, 3, 3, 3], conv_b: FLOAT[4], bn_scale: FLOAT[4],
            bn_bias: FLOAT[4], bn_mean: FLOAT[4], bn_var: FLOAT[4], fc_w: FLOAT[3, 4], fc_b: FLOAT[3]) -> FLOAT[2, 3]:
        c = op.Conv(x, conv_w, conv_b, pads=[1, 1, 1, 1])
        n = op.BatchNormalization(c, bn_scale, bn_bias, bn_mean, bn_var)
        p = op.MaxPool(op.Relu(n), kernel_shape=[2, 2], strides=[2, 2])
        return op.Gemm(op.Flatten(op.GlobalAveragePool(p)), fc_w, fc_b, transB=1)

    rng = np.random.default_rng(3)
    weights = {"conv_w": rng.standard_normal((4, 3, 3, 3)) / 5, "conv_b": rng.standard_normal(4) / 5,
               "bn_scale": 1 + rng.random(4), "bn_bias": rng.standard_normal(4) / 5, "bn_mean": rng.standard_normal(4) / 5,
               "bn_var": 1 + rng.random(4), "fc_w": rng.standard_normal((3, 4)) / 2, "fc_b": rng.standard_normal(3) / 5}
    return _with_initializers(cnn.to_model_proto(), {k: v.astype(np.float32) for k, v in weights.items()})


def onnxscript_gru():
    """An ONNX GRU (linear_before_reset) over 5 steps and a linear read-out of its last state."""
    @script()
    def gru(x: FLOAT[5, 2, 4], w: FLOAT[1, 18, 4], r: FLOAT[1, 18, 6], b: FLOAT[1, 36],
            head: FLOAT[6, 1]) -> FLOAT[2, 1]:
        _, last = op.GRU(x, w, r, b, hidden_size=6, linear_before_reset=1)
        return op.MatMul(op.Squeeze(last, op.Constant(value_ints=[0])), head)

    rng = np.random.default_rng(4)
    weights = {"w": rng.standard_normal((1, 18, 4)) / 2, "r": rng.standard_normal((1, 18, 6)) / 2,
               "b": rng.standard_normal((1, 36)) / 5, "head": rng.standard_normal((6, 1))}
    return _with_initializers(gru.to_model_proto(), {k: v.astype(np.float32) for k, v in weights.items()})


