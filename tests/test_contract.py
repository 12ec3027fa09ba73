"""The training-graph contract (docs/ir.md): names, roles, domain, opset, checker, state."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from generated_docs import assert_generated_block_current

import bridge
from bridge import contract
from bridge.pipeline.load import load_model

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "bridge" / "contract.py"
EXAMPLE = str(ROOT / "examples" / "models" / "mlp.onnx")


@pytest.fixture(scope="module")
def adam_model() -> bridge.TrainingModel:
    return bridge.to_training_onnx(EXAMPLE, loss="ce", optim="adam", optim_options={"lr": 0.01, "amsgrad": True})


def _roles(values) -> dict[str, str]:
    return {v.name: {p.key: p.value for p in v.metadata_props}.get("bridge.role") for v in values}


def test_inputs_follow_the_contract(adam_model):
    weights = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    slots = ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]  # torch.optim.Adam's state keys (amsgrad)
    expected = weights + [f"{w}.{s}" for w in weights for s in slots] + ["step", "lr", "features", "target"]
    assert [i.name for i in adam_model.model.graph.input] == expected
    roles = _roles(adam_model.model.graph.input)
    assert {roles[w] for w in weights} == {"weight"}
    assert roles["lr"] == "hyperparameter" and roles["target"] == "target" and roles["features"] == "input"
    assert {roles[f"{w}.{s}"] for w in weights for s in slots} == {"optimizer_state"}


def test_outputs_follow_the_contract(adam_model):
    names = [o.name for o in adam_model.model.graph.output]
    weights = adam_model.weights
    assert names[0] == "loss"
    assert names[1:1 + len(weights)] == [f"grad_{w}" for w in weights]
    updated = {n for n in names if n.startswith("updated_")}
    state_inputs = {i.name for i in adam_model.model.graph.input} - {"features", "target", "lr"}
    assert updated == {f"updated_{n}" for n in state_inputs}
    loss = adam_model.model.graph.output[0].type.tensor_type
    assert loss.elem_type == onnx.TensorProto.FLOAT and len(loss.shape.dim) == 0


def test_standard_onnx_only(adam_model):
    model = adam_model.model
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    assert all(node.domain == "" for node in model.graph.node)
    onnx.checker.check_model(model, full_check=True)


def test_weights_keep_initializer_names_and_values(adam_model):
    source = {i.name: onnx.numpy_helper.to_array(i) for i in load_model(EXAMPLE).graph.initializer}
    state = adam_model.initial_state()
    for name in adam_model.weights:
        np.testing.assert_array_equal(state[name], source[name])
    assert not {i.name for i in adam_model.model.graph.initializer} & set(adam_model.weights)


def test_initial_state_is_torch_optims(adam_model):
    """Compare with the state torch.optim.Adam creates on its first step (before the update)."""
    state = adam_model.initial_state()
    param = torch.nn.Parameter(torch.tensor(state["fc1.weight"]))
    opt = torch.optim.Adam([param], lr=0.01, amsgrad=True)
    param.grad = torch.zeros_like(param)
    opt.step()
    torch_state = opt.state[param]
    assert set(torch_state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    for slot in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        np.testing.assert_array_equal(state[f"fc1.weight.{slot}"], np.zeros_like(state["fc1.weight"]))
    assert float(state["step"]) == float(torch_state["step"]) - 1  # bridge stores steps done so far
    assert float(state["lr"]) == pytest.approx(0.01)


def test_lr_is_a_live_input(adam_model):
    """Changing lr between steps changes the update, without re-export."""
    rng = np.random.default_rng(0)
    batch = ({"features": rng.standard_normal((2, 8)).astype(np.float32)}, np.array([0, 2]))
    updates = []
    for lr in (0.01, 0.001):
        session = adam_model.session()
        session.lr = lr
        out = session.step(*batch)
        updates.append(out["updated_fc1.weight"] - adam_model.initial_state()["fc1.weight"])
    np.testing.assert_allclose(updates[1], updates[0] / 10, rtol=1e-4, atol=1e-9)


def test_shared_initializer_is_one_weight():
    """A weight used by two nodes (and reached through Identity) stays one input, one gradient."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["W"], ["W_alias"], name="dedup"),
            helper.make_node("MatMul", ["x", "W"], ["h"], name="first"),
            helper.make_node("MatMul", ["h", "W_alias"], ["y"], name="second"),
        ],
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [numpy_helper.from_array(w, "W")],
    )
    tm = bridge.to_training_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), loss="mse")
    assert tm.weights == ["W"]
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    target = np.zeros((3, 4), np.float32)
    got = tm.session().step({"x": x}, target)["grad_W"]
    weight = torch.tensor(w, requires_grad=True)
    torch.nn.functional.mse_loss(torch.tensor(x) @ weight @ weight, torch.tensor(target)).backward()
    np.testing.assert_allclose(got, weight.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_output_selects_the_loss_output():
    from onnx import TensorProto, helper, numpy_helper

    w = np.ones((2, 2), np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["first"]), helper.make_node("Relu", ["first"], ["second"])],
        "two_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2]) for n in ("first", "second")],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([[-1.0, -2.0]], np.float32)
    target = np.zeros((1, 2), np.float32)
    first = bridge.to_training_onnx(model, output="first").session().step({"x": x}, target)["loss"]
    second = bridge.to_training_onnx(model, output="second").session().step({"x": x}, target)["loss"]
    assert float(first) == pytest.approx(((x @ w) ** 2).mean())
    assert float(second) == pytest.approx(0.0)


def test_scalar_initializers_are_constants_unless_named():
    """0-d float initializers (exporter-made constants such as Gelu's 0.5) are not trained by
    default; trainable= can still name them."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"), helper.make_node("Mul", ["h", "half"], ["y"], name="scale")],
        "scalar_constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "half")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert bridge.to_training_onnx(model).weights == ["W"]
    assert "half" not in {i.name for i in bridge.to_training_onnx(model).model.graph.input}
    assert bridge.to_training_onnx(model, trainable=["W", "half"]).weights == ["W", "half"]


def test_contract_tables_in_docs_are_current():
    """docs/ir.md's tables of roles and keys are rendered from bridge/contract.py (docs/contract_tables.py)."""
    assert_generated_block_current("contract_tables.py", "ir.md", "render")


def test_every_role_and_key_is_documented():
    roles = {value for name, value in vars(contract.Role).items() if not name.startswith("_")}
    assert set(contract.ROLE_DOCS) == roles
    assert set(contract.INPUT_ROLES + contract.OUTPUT_ROLES) | set(contract.VALUE_ROLES.values()) == roles
    assert set(contract.TAG_KEYS) | set(contract.MODEL_KEYS) | {contract.ROLE} <= set(contract.KEY_DOCS)


_SIGNATURE = contract.StepSignature(["w", "b"], ["bn.mean"], [("w", "m"), ("b", "m"), ("w", "v")], ["x"],
                                    random=["drop.noise"], outputs=["y"])


@pytest.mark.parametrize("signature", [_SIGNATURE, _SIGNATURE.for_eval(["y", "z"]), *_SIGNATURE.split()],
                         ids=["step", "eval", "gradient", "update"])
def test_signature_flatten_unflatten_round_trip(signature):
    for outputs in (False, True):
        names = signature.output_names() if outputs else signature.input_names()
        assert len(set(names)) == len(names), "names are unique"
        values = {name: f"value of {name}" for name in reversed(names)}  # any insertion order
        flat = signature.flatten(values, outputs=outputs)
        assert flat == [f"value of {name}" for name in names]
        assert signature.unflatten(flat, outputs=outputs) == values
        with pytest.raises(ValueError, match="values for the"):
            signature.unflatten(flat[:-1], outputs=outputs)
        with pytest.raises(KeyError, match=names[0].replace(".", r"\.")):
            signature.flatten({name: 0 for name in names[1:]}, outputs=outputs)


def test_signature_order():
    """The documented order (docs/ir.md): state, data -> loss, gradients, updated state, outputs."""
    assert _SIGNATURE.input_names() == ["w", "b", "bn.mean", "w.m", "b.m", "w.v", "step", "lr", "x", "drop.noise",
                                        "target"]
    assert _SIGNATURE.output_names() == ["loss", "grad_w", "grad_b", "updated_w", "updated_b", "updated_bn.mean",
                                         "updated_w.m", "updated_b.m", "updated_w.v", "updated_step", "output_y"]
    gradient, update = _SIGNATURE.split()
    assert gradient.input_names() == ["w", "b", "bn.mean", "x", "drop.noise", "target"]
    assert update.input_names() == ["w", "b", "w.m", "b.m", "w.v", "step", "lr", "grad_w", "grad_b"]
    assert _SIGNATURE.input_roles()["w.v"] == contract.Role.OPTIMIZER_STATE
    assert update.input_roles()["grad_b"] == contract.Role.GRADIENT


def test_random_inputs_payload_round_trips(adam_model):
    assert contract.decode_random_inputs({}) == []
    names = ["drop.noise", "attn/drop.noise"]
    assert contract.decode_random_inputs({contract.RANDOM_INPUTS: contract.encode_random_inputs(names)}) == names
    assert contract.decode_random_inputs(contract.props(adam_model.model.metadata_props)) == []


_LIGHT = "import sys; {load}; heavy = {{'torch', 'onnx', 'numpy'}} & set(sys.modules); assert not heavy, heavy"


def test_contract_module_imports_nothing_heavy():
    """bridge/contract.py itself imports only the standard library (loaded alone, outside the package)."""
    load = (f"import importlib.util; spec = importlib.util.spec_from_file_location('contract', {str(CONTRACT)!r}); "
            "module = sys.modules['contract'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)")
    subprocess.run([sys.executable, "-c", _LIGHT.format(load=load)], check=True, cwd=ROOT)


# PEP 562: the package imports its submodules on first use (issue 13); before that ``import bridge`` imports torch
_LAZY_PACKAGE = "def __getattr__" in (ROOT / "bridge" / "__init__.py").read_text()


@pytest.mark.skipif(not _LAZY_PACKAGE, reason="bridge/__init__.py imports every submodule, torch included")
def test_import_bridge_contract_needs_no_torch():
    code = "import sys, bridge.contract; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_builder_node_context_tags_its_nodes_and_is_restored():
    """The exporter's per-node context (tags, value name hint) holds inside ``node_context`` only."""
    from bridge.pipeline.export.builder import EmitContext, GraphBuilder

    b = GraphBuilder()
    tags = {contract.PHASE: "backward", contract.LAYER: "/fc/Gemm", contract.KIND: "gemm"}
    with b.node_context(tags, "mm_1"):
        inside = b.op("Relu", "x")
    outside = b.op("Relu", inside)
    assert (b.nodes[0].name, str(inside)) == ("backward_gemm/fc/Gemm/Relu", "mm_1")
    assert contract.props(b.nodes[0].metadata_props) == tags
    assert b.context == EmitContext() and not b.nodes[1].metadata_props and str(outside) == "v"
    with pytest.raises(RuntimeError), b.node_context(tags, "y"):
        raise RuntimeError("an emitter failed")
    assert b.context == EmitContext()
