"""Symbolic dims beyond the batch (issue 12): one file trains a text model at any batch size AND
any sequence length. Each text model of the zoo is exported with a symbolic batch and sequence
(legacy exporter, opset 17, dynamic axes), converted ONCE with ``dynamic_dims=True``, and its
first Adam step at two lengths (12 and 20) and two batch sizes matches the torch module's own
first step there (the zoo's oracle and tolerance) and the static conversion at that size."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from zoo.harness import Case, assert_first_step, assert_onnx_mlir_clean, module_oracle, name_map, perturb
from zoo.torch_models import VOCAB, _LSTMTagger

import bridge
from bridge.cli import main
from bridge.pipeline.from_torch import HFLogits

LR = 1e-3
RTOL = 1e-4  # as the zoo
SIZES = ((2, 12), (3, 20))  # (batch, sequence length): two of each from one file
TRACE = (3, 5)  # the trace size: neither a step size nor a size of the model (heads 2, hidden 16)
POSITIONS = 32  # position tables long enough for length 20 (the zoo's tiny configs have 16)


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=POSITIONS, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return perturb(HFLogits(BertForSequenceClassification(config)), 0)


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(2)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=POSITIONS, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return perturb(HFLogits(GPT2LMHeadModel(config)), 2)


def _lstm_tagger() -> torch.nn.Module:
    torch.manual_seed(3)
    return perturb(_LSTMTagger(), 3)


# name -> (module builder, input names, per-token target)
TEXT = {"bert": (_bert, ["input_ids", "attention_mask"], False), "gpt2": (_gpt2, ["input_ids", "attention_mask"], True),
        "lstm_tagger": (_lstm_tagger, ["input_ids"], False)}


def _batch(names: list[str], per_token: bool, batch: int, length: int, seed: int) -> tuple[dict, np.ndarray]:
    """Token ids (no padding index 0), a mask with one padded sequence, class targets."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), np.int64)
    mask[1, length - 3:] = 0
    arrays = {"input_ids": rng.integers(1, VOCAB, (batch, length)).astype(np.int64), "attention_mask": mask}
    classes = VOCAB if per_token else 3
    target = rng.integers(0, classes, (batch, length) if per_token else (batch,)).astype(np.int64)
    return {name: arrays[name] for name in names}, target


def _export(module: torch.nn.Module, inputs: dict[str, np.ndarray], path, per_token: bool) -> str:
    axes = {name: {0: "batch", 1: "seq"} for name in inputs}
    axes["y"] = {0: "batch", 1: "seq"} if per_token else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), tuple(torch.from_numpy(v) for v in inputs.values()), str(path),
                          dynamo=False, opset_version=17, do_constant_folding=False, input_names=list(inputs),
                          output_names=["y"], dynamic_axes=axes)
    return str(path)


class _TinyAttention(torch.nn.Module):
    """Embedding + a learned position table sliced to the sequence length + one causal attention
    head + a per-token head; with ``pinned`` the table is sliced to a constant length (8)."""

    def __init__(self, pinned: bool = False):
        super().__init__()
        torch.manual_seed(4)
        self.pinned = pinned
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.positions = torch.nn.Parameter(torch.randn(POSITIONS, 8) * 0.1)
        self.qkv = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        length = 8 if self.pinned else input_ids.shape[1]
        x = self.embed(input_ids) + self.positions[:length]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / 8 ** 0.5
        causal = torch.ones(input_ids.shape[1], input_ids.shape[1]).tril() == 0
        attention = scores.masked_fill(causal, -1e4).softmax(-1)
        return self.head(x + attention @ v)


def _tiny_model(tmp_path, pinned: bool = False) -> tuple[torch.nn.Module, str]:
    module = _TinyAttention(pinned)
    inputs, _ = _batch(["input_ids"], True, 2, 8, seed=0)
    return module, _export(module, inputs, tmp_path / "tiny.onnx", per_token=True)


def _convert(path: str, optim: str = "adam", **options) -> bridge.TrainingModel:
    return bridge.to_training_onnx(path, loss="ce", optim=optim, optim_options={"lr": LR}, **options)


def _dims(model: onnx.ModelProto, names) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in model.graph.input if v.name in names}


def _text_model(name: str, tmp_path) -> tuple[torch.nn.Module, str]:
    build, names, per_token = TEXT[name]
    module = build()
    return module, _export(module, _batch(names, per_token, *TRACE, seed=0)[0], tmp_path / f"{name}.onnx", per_token)


def _check_text_model(name: str, tmp_path, static: bool = True) -> None:
    """Convert once, then at each of ``SIZES`` (an RNN: at the trace length, its batch alone
    symbolic) the first step = torch's, and with ``static`` = the static conversion's."""
    _, names, per_token = TEXT[name]
    module, path = _text_model(name, tmp_path)
    rnn = name == "lstm_tagger"
    dims = {"input_ids": {0: "batch"}} if rnn else True
    tm = _convert(path, dynamic_dims=dims, input_shapes={n: list(TRACE) for n in names})
    seq = TRACE[1] if rnn else "seq"
    for graph in (tm.model, tm.eval_model, tm.gradient_model):
        shapes = _dims(graph, [*names, "target"])
        assert all(shape[:2] == ["batch", seq] for n, shape in shapes.items() if n != "target"), shapes
        assert shapes["target"] == (["batch", seq] if per_token else ["batch"]), shapes
    assert_onnx_mlir_clean(tm, name)
    mapping, missing = name_map(module, path)
    assert not missing
    for seed, (batch, length) in enumerate(SIZES):
        length = TRACE[1] if rnn else length
        inputs, target = _batch(names, per_token, batch, length, seed)
        case = Case(f"{name}@{batch}x{length}", path, inputs, target, "ce", set(tm.weights),
                    module_oracle(module, mapping, inputs, target, "ce", LR), lr=LR, rtol=RTOL)
        got = tm.session().step(inputs, target)
        want, noise = case.oracle()
        assert_first_step(case, got, want, noise, tm.initial_state())
        evaluated = tm.session().evaluate(inputs, target)
        np.testing.assert_allclose(evaluated["loss"], got["loss"], rtol=1e-6)
        if static:
            fixed = _convert(path, dynamic_dims=False, input_shapes={n: [batch, length] for n in names})
            assert all(isinstance(d, int) for shape in _dims(fixed.model, names).values() for d in shape)
            expected = fixed.session().step(inputs, target)
            for key, value in expected.items():
                np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(value)))),
                                           err_msg=f"{name}@{batch}x{length}: {key} vs the static conversion")


def test_an_rnn_pins_the_length_and_names_its_node(tmp_path):
    """bridge unrolls an LSTM over time: a symbolic length is refused, naming the LSTM node."""
    _, path = _text_model("lstm_tagger", tmp_path)
    with pytest.raises(bridge.ShapeError, match=r"LSTM node '/lstm/LSTM' fixes the seq size to 5"):
        _convert(path, dynamic_dims=True, input_shapes={"input_ids": list(TRACE)})


@pytest.mark.slow
def test_bert_trains_at_lengths_12_and_20_from_one_file(tmp_path):
    _check_text_model("bert", tmp_path, static=False)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", sorted(TEXT))
def test_text_zoo_dynamic_dims_match_torch_and_static(name, tmp_path):
    _check_text_model(name, tmp_path)


def test_tiny_attention_trains_at_two_lengths_like_torch_and_static(tmp_path):
    """One file at (2, 12) and (3, 20) = torch, and = the static conversion at (3, 20); its
    position table bounds the length (bridge.dim_bounds)."""
    module, path = _tiny_model(tmp_path)
    tm = _convert(path, dynamic_dims={"input_ids": {0: "batch", 1: "seq"}}, input_shapes={"input_ids": list(TRACE)})
    assert _dims(tm.model, ["input_ids", "target"]) == {"input_ids": ["batch", "seq"], "target": ["batch", "seq"]}
    assert _dims(tm.update_model, ["input_ids"]) == {}  # the update graph reads no data
    assert bridge.check(tm.model, target="onnx-mlir", compile=False) == []
    mapping, _ = name_map(module, path)
    for seed, (batch, length) in enumerate(SIZES):
        inputs, target = _batch(["input_ids"], True, batch, length, seed)
        got = tm.session().step(inputs, target)
        case = Case(f"tiny@{batch}x{length}", path, inputs, target, "ce", set(tm.weights),
                    module_oracle(module, mapping, inputs, target, "ce", LR), lr=LR, rtol=RTOL)
        assert_first_step(case, got, *case.oracle(), tm.initial_state())
    static = _convert(path, dynamic_dims=False, input_shapes={"input_ids": [batch, length]}).session()
    for key, value in static.step(inputs, target).items():  # at the last size (every size: exhaustive tier)
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    # the 32-row position table bounds the length: 32 trains, 33 is refused before the step
    session = tm.session()
    session.step(*_batch(["input_ids"], True, 2, POSITIONS, 0))
    with pytest.raises(bridge.StepInputError, match=f"dim 'seq' is {POSITIONS + 1} .* up to {POSITIONS}"):
        session.step(*_batch(["input_ids"], True, 2, POSITIONS + 1, 0))


def test_a_length_pinned_by_a_constant_slice_names_the_node(tmp_path):
    _, path = _tiny_model(tmp_path, pinned=True)
    dims = {"input_ids": {0: "batch", 1: "seq"}}
    with pytest.raises(bridge.ShapeError, match=r"Add node '/Add' fixes the seq size to 8"):
        _convert(path, dynamic_dims=dims, input_shapes={"input_ids": [3, 8]})
    with pytest.raises(bridge.ShapeError, match=r"Add node '/Add' fails on these inputs"):
        _convert(path, dynamic_dims=dims, input_shapes={"input_ids": [3, 5]})


def _dropout_model() -> onnx.ModelProto:
    """[batch, seq, 4] -> MatMul -> Dropout(0.5): noise of the activations' symbolic shape."""
    weight = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], np.linspace(-1, 1, 12).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="matmul"),
         helper.make_node("Dropout", ["h"], ["y"], name="drop", ratio=0.5)],
        "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 3])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def test_noise_inputs_follow_the_symbolic_dims(tmp_path):
    tm = bridge.to_training_onnx(_dropout_model(), loss="mse", dynamic_dims=True, input_shapes={"x": [3, 5, 4]})
    assert _dims(tm.model, ["x", "drop.noise", "target"]) == {
        "x": ["batch", "T", 4], "drop.noise": ["batch", "T", 3], "target": ["batch", "T", 3]}
    rng = np.random.default_rng(0)
    for batch, length in SIZES:
        inputs = {"x": rng.standard_normal((batch, length, 4)).astype(np.float32)}
        target = rng.standard_normal((batch, length, 3)).astype(np.float32)
        drawn = tm.session(seed=0).step(inputs, target)  # noise drawn at this size by the runtime
        assert np.isfinite(drawn["loss"])
        noise = {"drop.noise": rng.random((batch, length, 3)).astype(np.float32)}
        static = bridge.to_training_onnx(_dropout_model(), loss="mse", dynamic_dims=False,
                                         input_shapes={"x": [batch, length, 4]})
        got = tm.session().step({**inputs, **noise}, target)
        for key, value in static.session().step({**inputs, **noise}, target).items():
            np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)


def test_dynamic_dims_options_are_checked():
    model = _dropout_model()
    for options, message in [({"dynamic_dims": {"z": [0]}}, "unknown inputs"),
                             ({"dynamic_dims": {"x": {3: "d"}}}, "has rank 3"),
                             ({"dynamic_dims": True, "dynamic_batch": True}, "not both")]:
        with pytest.raises(bridge.InvalidOptionError, match=message):
            bridge.to_training_onnx(model, loss="mse", **options)


def test_cli_dynamic_and_input_shapes(tmp_path, capsys):
    model = tmp_path / "dropout.onnx"
    onnx.save(_dropout_model(), model)
    out = tmp_path / "train.onnx"
    assert main(["convert", str(model), "-o", str(out), "--dynamic", "--input-shapes", "x=1x6x4"]) == 0
    assert _dims(onnx.load(out), ["x"]) == {"x": ["batch", "T", 4]}
    assert main(["convert", str(model), "-o", str(out), "--dynamic-dims", '{"x": {"1": "seq"}}',
                 "--input-shapes", "x=2x6x4"]) == 0
    assert _dims(onnx.load(out), ["x"]) == {"x": [2, "seq", 4]}
    assert main(["convert", str(model), "-o", str(out), "--input-shapes", "x=2,6,4"]) == 2
    assert "NAME=DIMxDIM" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.iree
def test_iree_compiled_once_trains_at_two_lengths(tmp_path):
    """The tiny attention model with a symbolic batch and length, compiled once by IREE, steps like
    onnxruntime at two lengths and batch sizes (state fed back from step to step)."""
    from helpers.reference import assert_steps_match

    _, path = _tiny_model(tmp_path)
    # SGD: the attention key bias has an exactly-zero gradient, which Adam turns into noise/|noise|
    tm = _convert(path, optim="sgd", dynamic_dims=True, input_shapes={"input_ids": list(TRACE)})
    iree, ort = bridge.compile(tm).session(), tm.session()
    for seed, (batch, length) in enumerate(SIZES):
        inputs, target = _batch(["input_ids"], True, batch, length, seed)
        assert_steps_match([iree.step(inputs, target)], [ort.step(inputs, target)])



def test_a_conv_net_trains_at_any_batch(tmp_path):
    """Tracing a Conv guards ``batch < 16`` (a torch kernel-choice heuristic): the batch is never bounded,
    so one dynamic-batch file of a CNN steps at batch 20 like its static conversion."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(4 * 6 * 6, 3))
    path = tmp_path / "cnn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 1, 6, 6),), str(path), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    tm = bridge.to_training_onnx(str(path), loss="ce", optim="sgd")
    assert "batch" not in json.loads({p.key: p.value for p in tm.model.metadata_props}.get("bridge.dim_bounds", "{}"))
    rng = np.random.default_rng(0)
    x, target = rng.standard_normal((20, 1, 6, 6)).astype(np.float32), rng.integers(0, 3, 20)
    static = bridge.to_training_onnx(str(path), loss="ce", optim="sgd", input_shapes={"x": [20, 1, 6, 6]},
                                     dynamic_batch=False)
    got, want = tm.session().step({"x": x}, target), static.session().step({"x": x}, target)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
