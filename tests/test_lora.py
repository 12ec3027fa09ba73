"""LoRA adapters (bridge/lora.py, ``to_training_onnx(lora=)``) train as peft's LoRA does: same
initial adapters, same optimizer steps, same losses, adapter gradients and adapters; the base weights stay
as they were; the merged export computes what the unmerged eval graph does."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from helpers.reference import bridge_steps, torch_steps
from lifecycle_models import LORA_TARGETS, lora_cnn, mlp_and_data
from onnx import TensorProto, helper
from onnx import numpy_helper as nh
from zoo import torch_models
from zoo.harness import tolerance, torch_loss

import bridge
from bridge.cli import main
from bridge.contract import LORA_PLAN
from bridge.errors import InvalidOptionError
from bridge.lora import LoraError, inject_lora, merge_lora

peft = pytest.importorskip("peft")
RANK, ALPHA, LR, STEPS = 4, 8.0, 0.1, 5


def _set(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> None:
    for init in model.graph.initializer:
        if init.name in values:
            init.CopyFrom(nh.from_array(values[init.name].astype(np.float32), init.name))


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feed)


def test_injected_mlp_trains_like_peft():
    module, model, x, y = mlp_and_data()
    lora = peft.get_peft_model(copy.deepcopy(module), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0", "2"]))
    injected, plan = inject_lora(model, rank=RANK, alpha=ALPHA, targets=["0.weight", "2.weight"])
    assert sorted(a.weight for a in plan.adapters) == ["0.weight", "2.weight"]
    layers = {"0.weight": lora.base_model.model[0], "2.weight": lora.base_model.model[2]}
    _set(injected, {a.a: layers[a.weight].lora_A["default"].weight.detach().numpy() for a in plan.adapters})
    tm = bridge.to_training_onnx(injected, "mse", "sgd", optim_options={"lr": LR}, trainable=plan.adapter_names)
    assert sorted(tm.weights) == sorted(plan.adapter_names)

    optimizer = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=LR)
    session = tm.session(seed=0)
    for step in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(lora(x), y)
        loss.backward()
        optimizer.step()
        got = session.step({"x": x.numpy()}, y.numpy())
        np.testing.assert_allclose(float(got["loss"]), loss.item(), rtol=1e-5, err_msg=f"step {step}")
    for adapter in plan.adapters:
        layer = layers[adapter.weight]
        for name, want in ((adapter.a, layer.lora_A["default"].weight), (adapter.b, layer.lora_B["default"].weight)):
            np.testing.assert_allclose(got[f"updated_{name}"], want.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert np.abs(got[f"updated_{plan.adapters[0].b}"]).max() > 0  # B left zero: the comparison would be vacuous

    merged = merge_lora(model, {k: got[f"updated_{k}"] for k in plan.adapter_names}, plan)
    np.testing.assert_allclose(_run(merged, {"x": x.numpy()})[0], lora(x).detach().numpy(), rtol=1e-4, atol=1e-6)


def _base_initializers(model: onnx.ModelProto, names) -> dict[str, bytes]:
    found = {t.name: nh.to_array(t).tobytes() for t in model.graph.initializer}
    return {name: found[name] for name in names}


def test_lora_option_trains_only_the_adapters(tmp_path):
    """``lora=``: the state and checkpoints hold the adapters and their optimizer state only; the base
    weights are the training graph's initializers under the source's names, bit for bit, and are the
    exported model's after training; merged and unmerged exports compute what the eval graph does."""
    _, model, x, y = mlp_and_data()
    tm = bridge.to_training_onnx(model, "mse", "adam", lora={"rank": 2, "alpha": 4, "targets": ["*.weight"]})
    adapters = tm.lora.adapter_names
    assert sorted(tm.weights) == sorted(adapters)
    slots = {f"{a}.{slot}" for a in adapters for slot in ("exp_avg", "exp_avg_sq")}
    assert set(tm.initial_state()) == set(adapters) | slots | {"step", "lr"}
    bases = [a.weight for a in tm.lora.adapters]
    source_bits = _base_initializers(model, bases)
    assert _base_initializers(tm.model, bases) == source_bits
    assert json.loads(dict((p.key, p.value) for p in tm.model.metadata_props)[LORA_PLAN])["rank"] == 2

    trainer = bridge.Trainer(tm)
    for _ in range(3):
        trainer.step({"x": x.numpy()}, y.numpy())
    with np.load(trainer.save_checkpoint(tmp_path / "ckpt.npz")) as saved:
        assert {k.removeprefix("state/") for k in saved.files if k != "meta"} == set(adapters) | slots | {"step", "lr"}
    evaluated = trainer.session.evaluate({"x": x.numpy()}, y.numpy())["output_y"]
    merged = onnx.load(trainer.export_inference(tmp_path / "merged.onnx"))
    unmerged = onnx.load(trainer.export_inference(tmp_path / "unmerged.onnx", merge=False))
    assert [n.op_type for n in merged.graph.node] == [n.op_type for n in model.graph.node]
    assert _base_initializers(unmerged, bases) == source_bits
    assert np.abs(evaluated - _run(model, {"x": x.numpy()})[0]).max() > 1e-3  # the adapters changed the output
    noise = 4 * np.finfo(np.float32).eps * np.abs(evaluated).max()  # one re-association of each sum
    for exported in (merged, unmerged):
        np.testing.assert_allclose(_run(exported, {"x": x.numpy()})[0], evaluated, rtol=0, atol=noise)


@pytest.mark.parametrize(("lora", "named"), [
    ({"rank": 2, "targets": ["*"], "dropout": 0.1}, "dropout"),
    ({"rank": 0, "targets": ["*"]}, "rank=0"),
    ({"rank": 2.5, "targets": ["*"]}, "rank=2.5"),
    ({"rank": 2}, "targets"),
    ({"rank": 2, "targets": ["*attn*"]}, "0.weight"),  # names what could be targeted
    ({"rank": 2, "targets": []}, "targets"),
    ("rank=2", "dict"),
])
def test_bad_lora_options_name_the_option(lora, named):
    _, model, _, _ = mlp_and_data()
    with pytest.raises(InvalidOptionError, match="lora") as caught:
        bridge.to_training_onnx(model, "mse", "sgd", lora=lora)
    assert named in str(caught.value)


def test_a_shared_weight_exports_unmerged_only(tmp_path):
    """A weight that a Gather also reads (a tied embedding): merging its adapter would change the Gather's rows
    too, so the merged export is refused naming the weight; the unmerged one computes the eval graph's output."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["projected"]), helper.make_node("Gather", ["W", "ids"], ["rows"]),
         helper.make_node("Add", ["projected", "rows"], ["y"])], "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]), helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [nh.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    tm = bridge.to_training_onnx(model, "mse", "sgd", optim_options={"lr": 0.5}, lora={"rank": 2, "targets": ["W"]})
    feed, target = {"x": rng.standard_normal((2, 4)).astype(np.float32), "ids": np.array([1, 3])}, np.zeros((2, 4), np.float32)
    session = tm.session()
    for _ in range(2):
        session.step(feed, target)
    with pytest.raises(LoraError, match="'W' is read by") as caught:
        tm.export_inference(tmp_path / "merged.onnx", session.state)
    assert "separately" in str(caught.value)
    evaluated = session.evaluate(feed, target)["output_y"]
    unmerged = onnx.load(tm.export_inference(tmp_path / "unmerged.onnx", session.state, merge=False))
    assert np.abs(evaluated - _run(model, feed)[0]).max() > 1e-3  # the adapters changed the output
    np.testing.assert_allclose(_run(unmerged, feed)[0], evaluated, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(evaluated).max())


def test_cli_converts_with_lora_and_exports_merged_or_not(tmp_path, capsys):
    _, model, x, y = mlp_and_data()
    onnx.save(model, tmp_path / "mlp.onnx")
    train = tmp_path / "train.onnx"
    options = json.dumps({"rank": 2, "alpha": 2, "targets": ["2.*"]})
    assert main(["convert", str(tmp_path / "mlp.onnx"), "-o", str(train), "--optim", "adam", "--lora", options]) == 0
    trainer = bridge.Trainer(train)
    adapters = ["2.weight.lora_A", "2.weight.lora_B"]
    assert set(trainer.state()) == {*adapters, *(f"{a}.{s}" for a in adapters for s in ("exp_avg", "exp_avg_sq")), "step", "lr"}
    for _ in range(3):
        trainer.step({"x": x.numpy()}, y.numpy())
    trainer.save_checkpoint(tmp_path / "ckpt.npz")
    evaluated = trainer.session.evaluate({"x": x.numpy()}, y.numpy())["output_y"]
    for flag, name in (([], "merged.onnx"), (["--unmerged"], "unmerged.onnx")):
        assert main(["export-inference", str(tmp_path / "mlp.onnx"), "--train", str(train), "--checkpoint",
                     str(tmp_path / "ckpt.npz"), "-o", str(tmp_path / name), *flag]) == 0
        exported = onnx.load(tmp_path / name)
        assert ("2.weight.lora_A" in {t.name for t in exported.graph.initializer}) == bool(flag)
        np.testing.assert_allclose(_run(exported, {"x": x.numpy()})[0], evaluated, rtol=0,
                                   atol=4 * np.finfo(np.float32).eps * np.abs(evaluated).max())
    assert main(["convert", str(tmp_path / "mlp.onnx"), "-o", str(tmp_path / "bad.onnx"), "--lora", '{"rank": -1, "targets": "*"}']) != 0
    assert "rank=-1" in capsys.readouterr().err


# -- against peft + torch, 5 SGD steps ----------------------------------------------------------------------


# model -> (builder, bridge's targets, peft's target_modules: the same layers)
PEFT_CASES = {
    "bert_tiny": (torch_models.bert, LORA_TARGETS["bert_tiny"], r".*encoder.*\.(query|key|value|dense)"),
    "gpt2_tiny": (torch_models.gpt2, LORA_TARGETS["gpt2_tiny"], ["c_attn", "c_proj", "c_fc"]),
    "cnn": (lora_cnn, LORA_TARGETS["cnn"], ["conv1", "conv2", "head"]),
}


def _peft_steps(lora_module: torch.nn.Module, names: dict[str, str], adapters: dict[str, np.ndarray],
                inputs: dict[str, np.ndarray], target: np.ndarray, loss: str, dtype: torch.dtype) -> list[dict]:
    """``STEPS`` SGD steps of the peft module's adapters (bridge name -> peft parameter name in ``names``),
    in ``dtype``, through ``reference.torch_steps``."""
    module = copy.deepcopy(lora_module).to(dtype)
    float_type = np.float64 if dtype == torch.float64 else np.float32

    def forward(params, batch):
        return torch.func.functional_call(module, {names[k]: v for k, v in params.items()}, tuple(batch.values()))

    batch = ({k: v.astype(float_type) if v.dtype.kind == "f" else v for k, v in inputs.items()}, target)
    weights = {k: v.astype(float_type) for k, v in adapters.items()}
    return torch_steps(forward, weights, torch_loss(loss), torch.optim.SGD, {"lr": LR}, [batch] * STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", PEFT_CASES)
def test_lora_trains_like_peft(name):
    build, targets, peft_targets = PEFT_CASES[name]
    module, inputs, target, loss = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: gpt2's Conv1D sets fan_in_fan_out
        lora_module = peft.inject_adapter_in_model(peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=peft_targets),
                                                   copy.deepcopy(module))
    tm = bridge.to_training_onnx(module, loss, "sgd", optim_options={"lr": LR},
                                 example_inputs=tuple(torch.from_numpy(v) for v in inputs.values()),
                                 lora={"rank": RANK, "alpha": ALPHA, "targets": targets})
    peft_layers = {n for n, m in lora_module.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert {a.weight.removesuffix(".weight") for a in tm.lora.adapters} == peft_layers
    names = {}
    for adapter in tm.lora.adapters:
        layer = adapter.weight.removesuffix(".weight")
        names[adapter.a], names[adapter.b] = f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight"
    # the base weights are the graph's constants bit for bit: as the module holds them, or transposed where the
    # export reads them through a Transpose (folded when traced, a frozen weight being a constant); not in the state
    held = {nh.to_array(t).tobytes() for t in tm.model.graph.initializer}
    for adapter in tm.lora.adapters:
        weight = module.get_parameter(adapter.weight).detach().numpy()
        assert {weight.tobytes(), np.ascontiguousarray(weight.T).tobytes()} & held, adapter.weight
        assert adapter.weight not in tm.initial_state()
    peft_params = dict(lora_module.named_parameters())
    adapters = {k: peft_params[v].detach().numpy().copy() for k, v in names.items()}
    tm.initial_values.update(adapters)  # peft's A (B: zeros in both)
    feed = dict(zip(tm.data_inputs, inputs.values(), strict=True))

    got = bridge_steps(tm, [(feed, target)] * STEPS)
    want = _peft_steps(lora_module, names, adapters, inputs, target, loss, torch.float64)
    want32 = _peft_steps(lora_module, names, adapters, inputs, target, loss, torch.float32)
    for step, (g, w, w32) in enumerate(zip(got, want, want32, strict=True)):
        for key, expected in w.items():
            noise = float(np.abs(w32[key] - expected).max())
            np.testing.assert_allclose(g[key], expected, rtol=1e-5, atol=tolerance(1e-5, expected, noise),
                                       err_msg=f"{name} step {step}: {key}")
    b_grads = [got[0][f"grad_{a.b}"] for a in tm.lora.adapters]
    a_grads = [got[-1][f"grad_{a.a}"] for a in tm.lora.adapters]
    assert all(np.abs(g).max() > 0 for g in b_grads + a_grads)  # every adapter moved: the check is not vacuous

    state = {**tm.initial_state(), **{k.removeprefix("updated_"): v for k, v in got[-1].items() if k.startswith("updated_")}}
    session = tm.session()
    session.state.update(state)
    evaluated = session.evaluate(feed, target)
    merged = tm.inference_model(state)
    assert {t.name for t in merged.graph.initializer} == {t.name for t in tm.source.graph.initializer}
    output = _run(merged, feed)[0]
    want_output = evaluated[f"output_{tm.source.graph.output[0].name}"]
    np.testing.assert_allclose(output, want_output, rtol=1e-5, atol=tolerance(1e-5, want_output, 0.0))


def test_guide_example_runs(tmp_path):
    """docs/lora.md's example, as written: it trains the adapters and writes both exports."""
    code = re.search(r"```python\n(.*?)```", (Path(__file__).parent.parent / "docs" / "lora.md").read_text(), re.DOTALL).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'0.weight.lora_A', '0.weight.lora_B', '2.weight.lora_A', '2.weight.lora_B'" in result.stdout
    merged, unmerged = (onnx.load(tmp_path / name) for name in ("merged.onnx", "with_adapters.onnx"))
    feed = {merged.graph.input[0].name: np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)}
    want = _run(unmerged, feed)[0]
    np.testing.assert_allclose(_run(merged, feed)[0], want, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(want).max())
