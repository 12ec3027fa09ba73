"""Lookups on trainable tensors (Gather, GatherElements, torch.nn.Embedding): repeated indices
accumulate their gradients, with no ScatterElements/ScatterND in the training graph."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from helpers.single_op import one_node_model, train_and_compare
from helpers.training import assert_trains_like

import bridge

rng = np.random.default_rng(3)
SCATTERS = {"ScatterElements", "ScatterND", "Scatter"}


def _batches(indices: np.ndarray, target_shape, count=2, dtype=np.float64):
    return [({"idx": indices}, rng.standard_normal(target_shape).astype(dtype)) for _ in range(count)]


def _no_scatter(tm: bridge.TrainingModel) -> bool:
    return not ({n.op_type for n in tm.model.graph.node} & SCATTERS)


@pytest.mark.parametrize("indices", [
    np.array([[0, 2, 2, 5], [5, 5, 5, 1]]),  # repeated within and across rows
    np.array([3, 3, 3, 3, 3, 3]),             # one row looked up six times
    np.array([[-1, 0], [5, -6]]),             # negative indices count from the end
    np.array(4),                              # a scalar index
], ids=["repeats", "same_row", "negative", "scalar"])
def test_gather_axis0_on_a_weight_accumulates(indices):
    table = rng.standard_normal((6, 3))
    out_shape = indices.shape + (3,)
    model = one_node_model("Gather", ["table", "idx"], {"idx": indices}, {"table": table}, 13,
                           out_dtype=np.float64, axis=0)

    def twin(p, inputs):
        return p["table"][inputs["idx"]]

    tm, _ = train_and_compare(model, {"table": table}, twin, _batches(indices, out_shape), steps_rtol=1e-9)
    assert _no_scatter(tm)


def test_gather_of_many_indices_for_onnx_mlir_accumulates():
    """The onnx-mlir target's scatter of 256 indices into a 64-wide table (one 2-D product, a Gemm under
    ``long_inner_gemm``) sums repeated rows as torch does."""
    table = rng.standard_normal((40, 64))
    indices = rng.integers(0, 40, size=(2, 128))
    model = one_node_model("Gather", ["table", "idx"], {"idx": indices}, {"table": table}, 13,
                           out_dtype=np.float64, axis=0)

    def twin(p, inputs):
        return p["table"][inputs["idx"]]

    tm, _ = train_and_compare(model, {"table": table}, twin, _batches(indices, indices.shape + (64,)), steps_rtol=1e-9,
                              target="onnx-mlir")
    assert _no_scatter(tm)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_gather_other_axes_on_a_weight_accumulates(axis):
    data = rng.standard_normal((2, 4, 5))
    indices = np.array([[1, 1], [3, 0], [1, 3]])
    model = one_node_model("Gather", ["data", "idx"], {"idx": indices}, {"data": data}, 13, out_dtype=np.float64, axis=axis)
    dim = axis % 3
    out_shape = data.shape[:dim] + indices.shape + data.shape[dim + 1:]

    def twin(p, inputs):
        return torch.index_select(p["data"], dim, inputs["idx"].reshape(-1)).reshape(out_shape)

    tm, _ = train_and_compare(model, {"data": data}, twin, _batches(indices, out_shape), steps_rtol=1e-9)
    assert _no_scatter(tm)


@pytest.mark.parametrize("axis, index_shape", [(0, (5, 3)), (1, (2, 6)), (1, (2, 2)), (-1, (1, 4))])
def test_gather_elements_on_a_weight_accumulates(axis, index_shape):
    data = rng.standard_normal((4, 3))
    size = data.shape[axis]
    indices = rng.integers(-size, size, size=index_shape)
    model = one_node_model("GatherElements", ["data", "idx"], {"idx": indices}, {"data": data}, 13,
                           out_dtype=np.float64, axis=axis)

    def twin(p, inputs):
        idx = inputs["idx"]
        return torch.gather(p["data"], axis, torch.where(idx < 0, idx + size, idx))

    tm, _ = train_and_compare(model, {"data": data}, twin, _batches(indices, index_shape), steps_rtol=1e-9)
    assert _no_scatter(tm)


def test_torch_embedding_model_matches_torch():
    """nn.Embedding -> Linear exported by torch; tokens repeat inside and across sequences."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Flatten(), torch.nn.Linear(20, 3))
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 5, dtype=torch.long),), buffer, dynamo=False,
                      input_names=["tokens"], output_names=["y"])
    tm = bridge.to_training_onnx(onnx.load_from_string(buffer.getvalue()), loss="ce", optim="adam",
                                 optim_options={"lr": 0.01})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    assert _no_scatter(tm)
    batches = [({"tokens": rng.integers(0, 11, size=(2, 5))}, rng.integers(0, 3, size=2)) for _ in range(3)]
    batches[0][0]["tokens"][:] = [[1, 1, 1, 2, 1], [2, 2, 7, 1, 10]]
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.Adam, {"lr": 0.01}, inputs=["tokens"])


def _padded_embedding_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Embedding(11, 4, padding_idx=3), torch.nn.Flatten(), torch.nn.Linear(20, 3))


def test_embedding_padding_row_gets_no_gradient_from_a_torch_module():
    """A module's nn.Embedding(padding_idx=3): bridge trains what torch trains, the padding row untouched
    (its gradient exactly 0) although the padding token is looked up and reaches the loss."""
    module = _padded_embedding_model()
    tokens = np.array([[3, 1, 3, 2, 3], [2, 3, 7, 1, 10]])
    tm = bridge.to_training_onnx(module, example_inputs=(torch.from_numpy(tokens),), loss="ce", optim="adam",
                                 optim_options={"lr": 0.01})
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == [] and _no_scatter(tm)
    batches = [({"input": tokens}, np.array([0, 2]))] + [
        ({"input": rng.integers(0, 11, size=(2, 5))}, rng.integers(0, 3, size=2)) for _ in range(2)]
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.Adam, {"lr": 0.01}, inputs=["input"])
    grad = tm.session().step(*batches[0])["grad_0.weight"]
    assert np.all(grad[3] == 0) and np.abs(grad[[1, 2]]).min(axis=1).max() > 0


def test_padding_idx_metadata_on_an_onnx_file():
    """An ONNX file's Gather tagged with bridge.padding_idx trains like nn.Embedding(padding_idx=...);
    a tag that cannot be a padding row is refused naming the node."""
    module = _padded_embedding_model()
    model = bridge.export_for_training(module, (torch.zeros(2, 5, dtype=torch.long),))
    gather = next(node for node in model.graph.node if node.op_type == "Gather")
    assert [(p.key, p.value) for p in gather.metadata_props] == [("bridge.padding_idx", "3")]
    batches = [({"input": np.array([[3, 3, 0, 1, 2], [4, 3, 5, 6, 3]])}, np.array([1, 2]))]
    tm = bridge.to_training_onnx(model, loss="ce", optim="adam", optim_options={"lr": 0.01})
    assert_trains_like(tm, module, batches, F.cross_entropy, torch.optim.Adam, {"lr": 0.01}, inputs=["input"])
    gather.metadata_props[0].value = "11"  # past the table's 11 rows
    with pytest.raises(bridge.BridgeError, match=f"Gather node '{gather.name}': bridge.padding_idx='11'"):
        bridge.to_training_onnx(model, loss="ce", optim="adam")
