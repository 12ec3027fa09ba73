"""Symbolic dims beyond the batch (issue 12): one file trains a text model at any batch size AND
any sequence length. Each text model of the zoo is exported with a symbolic batch and sequence
(legacy exporter, opset 17, dynamic axes), converted ONCE with ``dynamic_dims=True``, and its
first Adam step at two lengths (12 and 20) and two batch sizes matches the torch module's own
first step there (the zoo's oracle and tolerance) and the static conversion at that size."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import bridge
from zoo.harness import Case, assert_first_step, assert_onnx_mlir_clean, module_oracle, name_map, perturb
from zoo.torch_models import VOCAB, _HFOutput, _LSTMTagger

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
    return perturb(_HFOutput(BertForSequenceClassification(config)), 0)


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(2)
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=POSITIONS, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return perturb(_HFOutput(GPT2LMHeadModel(config)), 2)


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


def _convert(path: str, **options) -> bridge.TrainingModel:
    return bridge.to_training_onnx(path, loss="ce", optim="adam", optim_options={"lr": LR}, **options)


def _dims(model: onnx.ModelProto, names) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in model.graph.input if v.name in names}


def _check_text_model(name: str, tmp_path, sizes=SIZES, static: bool = True) -> None:
    build, names, per_token = TEXT[name]
    module = build()
    example, _ = _batch(names, per_token, *TRACE, seed=0)
    path = _export(module, example, tmp_path / f"{name}.onnx", per_token)
    tm = _convert(path, dynamic_dims=True, input_shapes={n: list(TRACE) for n in names})
    for graph in (tm.model, tm.eval_model, tm.gradient_model):
        dims = _dims(graph, [*names, "target"])
        assert all(shape[:2] == ["batch", "seq"] for n, shape in dims.items() if n != "target"), dims
        assert dims["target"] == (["batch", "seq"] if per_token else ["batch"]), dims
    assert_onnx_mlir_clean(tm, name)
    mapping, missing = name_map(module, path)
    assert not missing
    for seed, (batch, length) in enumerate(sizes):
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


@pytest.mark.slow
def test_bert_trains_at_lengths_12_and_20_from_one_file(tmp_path):
    _check_text_model("bert", tmp_path, static=False)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_text_zoo_dynamic_dims_match_torch_and_static(name, tmp_path):
    _check_text_model(name, tmp_path)
