"""Every loss and option: loss, gradients and the updated weights match torch over 2 steps.

Models are tiny torch modules exported to ONNX once per module; the torch side computes the
same loss with ``torch.nn.functional`` (or the given module / callable) on the same weights.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.reference import assert_steps_match, bridge_steps, torch_steps
from helpers.training import assert_trains_like

import bridge
from bridge.pipeline.losses import available_losses
from bridge.pipeline.lowering.loss import xlogy
from bridge.tools.target_check import check

C = 4
WEIGHT = [0.5, 2.0, 1.0, 3.0]


class Head(torch.nn.Module):
    """Linear -> Tanh -> Linear over the last dim, then an optional final transform."""

    def __init__(self, final=None):
        super().__init__()
        self.fc1, self.fc2, self.final = torch.nn.Linear(6, 8), torch.nn.Linear(8, C), final

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        return self.final(y) if self.final else y


MODELS = {  # name -> (final transform, input shape)
    "logits": (None, (5, 6)),
    "probs": (torch.sigmoid, (5, 6)),
    "logprobs": (lambda y: torch.log_softmax(y, -1), (5, 6)),
    "sequence": (lambda y: y.reshape(2, 3, C), (6, 6)),  # [N, T, V]: the language-model convention
    "spatial": (lambda y: y.reshape(2, 2, 3, C).permute(0, 3, 1, 2), (12, 6)),  # [N, C, H, W]
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("losses")
    built = {}
    for name, (final, shape) in MODELS.items():
        torch.manual_seed(0)
        module = Head(final)
        path = folder / f"{name}.onnx"
        torch.onnx.export(module, (torch.randn(shape),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
        built[name] = (module, str(path))
    return built


def _targets(kind: str, shape, rng) -> np.ndarray:
    if kind == "indices":
        return rng.integers(0, C, size=shape).astype(np.int64)
    if kind == "probabilities":
        return torch.softmax(torch.tensor(rng.standard_normal(shape)), -1).numpy().astype(np.float32)
    if kind == "log_probabilities":
        return torch.log_softmax(torch.tensor(rng.standard_normal(shape)), -1).numpy().astype(np.float32)
    if kind == "unit":
        return rng.uniform(0, 1, size=shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def _torch_options(options: dict) -> dict:
    return {k: torch.tensor(v) if isinstance(v, list) else v for k, v in options.items() if k != "label_format"}


def _sequence_last(fn):
    """torch's own convention is classes on dim 1: move the vocabulary dim there."""
    return lambda out, tgt, **o: fn(out.transpose(1, 2), tgt.transpose(1, 2) if tgt.dim() == 3 else tgt, **o)


# (model, loss name, options, target kind, torch function)
CASES = [
    ("logits", "mse", {}, "real", F.mse_loss),
    ("logits", "mse", {"reduction": "sum"}, "real", F.mse_loss),
    ("logits", "ce", {}, "indices", F.cross_entropy),
    ("logits", "cross_entropy", {"reduction": "sum"}, "indices", F.cross_entropy),
    ("logits", "ce", {"label_smoothing": 0.1}, "indices", F.cross_entropy),
    ("logits", "ce", {"weight": WEIGHT}, "indices", F.cross_entropy),
    ("logits", "ce", {"ignore_index": 1}, "indices", F.cross_entropy),
    ("logits", "ce", {"weight": WEIGHT, "ignore_index": 2, "label_smoothing": 0.2, "reduction": "sum"}, "indices", F.cross_entropy),
    ("logits", "ce", {"label_format": "probabilities"}, "probabilities", F.cross_entropy),
    ("logits", "ce", {"label_format": "probabilities", "label_smoothing": 0.1, "weight": WEIGHT}, "probabilities", F.cross_entropy),
    ("sequence", "ce", {"ignore_index": 0}, "indices", _sequence_last(F.cross_entropy)),
    ("sequence", "ce", {"label_format": "probabilities"}, "probabilities", _sequence_last(F.cross_entropy)),
    ("spatial", "ce", {"weight": WEIGHT, "label_smoothing": 0.1}, "indices", F.cross_entropy),
    ("logits", "bce_with_logits", {}, "unit", F.binary_cross_entropy_with_logits),
    ("logits", "bce_with_logits", {"pos_weight": WEIGHT}, "unit", F.binary_cross_entropy_with_logits),
    ("logits", "bce_with_logits", {"weight": WEIGHT, "reduction": "sum"}, "unit", F.binary_cross_entropy_with_logits),
    ("probs", "bce", {}, "unit", F.binary_cross_entropy),
    ("probs", "bce", {"weight": WEIGHT, "reduction": "sum"}, "unit", F.binary_cross_entropy),
    ("logits", "l1", {}, "real", F.l1_loss),
    ("logits", "l1", {"reduction": "sum"}, "real", F.l1_loss),
    ("logits", "smooth_l1", {}, "real", F.smooth_l1_loss),
    ("logits", "smooth_l1", {"beta": 0.5, "reduction": "sum"}, "real", F.smooth_l1_loss),
    ("logits", "huber", {}, "real", F.huber_loss),
    ("logits", "huber", {"delta": 0.5, "reduction": "sum"}, "real", F.huber_loss),
    ("logprobs", "nll", {}, "indices", F.nll_loss),
    ("logprobs", "nll", {"weight": WEIGHT, "ignore_index": 1, "reduction": "sum"}, "indices", F.nll_loss),
    ("sequence", "nll", {}, "indices", _sequence_last(F.nll_loss)),
    ("logprobs", "kl_div", {"reduction": "batchmean"}, "probabilities", F.kl_div),
    ("logprobs", "kl_div", {"reduction": "sum"}, "probabilities", F.kl_div),
    ("logprobs", "kl_div", {}, "probabilities", F.kl_div),
    ("logprobs", "kl_div", {"log_target": True}, "log_probabilities", F.kl_div),
]


def _case_id(case) -> str:
    model, name, options, _, _ = case
    return f"{name}-{model}" + "".join(f"-{k}={v}" for k, v in options.items())


def _run(models, model, loss, options, kind, torch_loss, steps=2):
    module, path = models[model]
    tm = bridge.to_training_onnx(path, loss=loss, loss_options=options, optim="sgd", optim_options={"lr": 0.1})
    rng = np.random.default_rng(7)
    shape = MODELS[model][1]
    batches = [({"x": rng.standard_normal(shape).astype(np.float32)}, _targets(kind, tm.target_shape, rng)) for _ in range(steps)]
    if kind == "indices" and "ignore_index" in (options or {}):
        assert any((t == options["ignore_index"]).any() for _, t in batches), "some targets must be ignored"
    assert_trains_like(tm, module, batches, torch_loss, torch.optim.SGD, {"lr": 0.1})
    return tm


def _loss_ops(tm) -> set[str]:
    ops = set()
    for node in tm.model.graph.node:
        tags = {p.key: p.value for p in node.metadata_props}
        if tags.get("bridge.phase") == "loss":
            ops.add(node.op_type)
    return ops


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_loss_and_gradients_match_torch(models, case):
    model, loss, options, kind, fn = case
    torch_loss = lambda out, tgt: fn(out, tgt, **_torch_options(options))  # noqa: E731
    tm = _run(models, model, loss, options, kind, torch_loss)
    ops = {node.op_type for node in tm.model.graph.node}
    assert not ops & {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}
    assert _loss_ops(tm), "the loss is tagged phase 'loss'"
    assert all(node.domain in ("", "ai.onnx") for node in tm.model.graph.node)
    assert not check(tm.model, compile=False), "onnx-mlir accepts every op"


def test_every_loss_is_covered():
    names = {case[1] for case in CASES}
    assert set(available_losses()) <= names | {"cross_entropy"}


MODULE_CASES = [
    ("logits", torch.nn.CrossEntropyLoss(weight=torch.tensor(WEIGHT), label_smoothing=0.1, ignore_index=3), {}, "indices"),
    ("logits", torch.nn.CrossEntropyLoss(), {"label_format": "probabilities"}, "probabilities"),
    ("sequence", torch.nn.CrossEntropyLoss(reduction="sum"), {}, "indices"),
    ("logits", torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(WEIGHT)), {}, "unit"),
    ("logits", torch.nn.HuberLoss(delta=0.3, reduction="sum"), {}, "real"),
    ("logprobs", torch.nn.NLLLoss(weight=torch.tensor(WEIGHT)), {}, "indices"),
    ("logprobs", torch.nn.KLDivLoss(reduction="batchmean", log_target=True), {}, "log_probabilities"),
]


@pytest.mark.parametrize("model, module, options, kind", MODULE_CASES, ids=lambda v: type(v).__name__ if isinstance(v, torch.nn.Module) else None)
def test_loss_module_instance_matches_itself(models, model, module, options, kind):
    torch_loss = _sequence_last(module) if model == "sequence" else module
    tm = _run(models, model, module, options, kind, torch_loss)
    assert np.issubdtype(tm.target_dtype, np.integer) == (kind == "indices")


def _quartic(out, tgt):
    return ((out - tgt) ** 4).mean()


def _picked(out, tgt):
    return -out.gather(1, tgt.unsqueeze(1)).mean()


def _smoothed(out, tgt):
    """torch's composite: its masked_fill_ traces to copy_ (the in-place emitter)."""
    return F.cross_entropy(out, tgt, label_smoothing=0.2)


@pytest.mark.parametrize("fn, options, kind", [
    (_quartic, {}, "real"), (_picked, {"label_format": "indices"}, "indices"), (_smoothed, {"label_format": "indices"}, "indices"),
], ids=["float_target", "indices", "inplace_copy"])
def test_callable_loss_matches_torch(models, fn, options, kind):
    tm = _run(models, "logits", fn, options, kind, fn)
    assert _loss_ops(tm)


DYNAMIC_CASES = [  # one per loss, on a model whose batch dim is symbolic
    ("mse", {}, "real", F.mse_loss),
    ("ce", {"weight": WEIGHT, "ignore_index": 1, "label_smoothing": 0.1}, "indices", F.cross_entropy),
    ("ce", {"label_format": "probabilities"}, "probabilities", F.cross_entropy),
    ("bce_with_logits", {"pos_weight": WEIGHT}, "unit", F.binary_cross_entropy_with_logits),
    ("l1", {}, "real", F.l1_loss),
    ("smooth_l1", {"beta": 0.5}, "real", F.smooth_l1_loss),
    ("huber", {"delta": 0.5}, "real", F.huber_loss),
    ("kl_div", {"reduction": "batchmean"}, "probabilities", F.kl_div),
]


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    torch.manual_seed(0)
    module = Head()
    path = tmp_path_factory.mktemp("dynamic") / "head.onnx"
    torch.onnx.export(module, (torch.randn(5, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return module, str(path)


@pytest.mark.parametrize("loss, options, kind, fn", DYNAMIC_CASES, ids=[f"{c[0]}-{len(c[1])}opts" for c in DYNAMIC_CASES])
def test_losses_with_a_symbolic_batch_match_torch(dynamic_model, loss, options, kind, fn):
    """One graph, batches of 2, 5 and 7: the mean's 1/N follows the batch."""
    module, path = dynamic_model
    tm = bridge.to_training_onnx(path, loss=loss, loss_options=options, optim="sgd", optim_options={"lr": 0.1})
    rng = np.random.default_rng(11)
    target_tail = (C,) if kind != "indices" else ()
    batches = [({"x": rng.standard_normal((n, 6)).astype(np.float32)}, _targets(kind, (n, *target_tail), rng)) for n in (2, 5, 7)]
    weights = {n: p.detach().numpy() for n, p in module.named_parameters()}

    def forward(params, inputs):
        return torch.func.functional_call(module, params, (inputs["x"],))

    torch_loss = lambda out, tgt: fn(out, tgt, **_torch_options(options))  # noqa: E731
    want = torch_steps(forward, weights, torch_loss, torch.optim.SGD, {"lr": 0.1}, batches)
    assert_steps_match(bridge_steps(tm, batches), want)


def test_xlogy_lowering_matches_torch():
    x = torch.tensor([0.0, 0.0, 2.0, 0.5, 0.0, 1.0])
    y = torch.tensor([0.0, 3.0, 0.5, float("nan"), float("nan"), 0.0])
    torch.testing.assert_close(xlogy(x, y), torch.xlogy(x, y), equal_nan=True)


def test_inplace_op_with_a_stale_alias_is_refused():
    """An in-place op is emitted as its out-of-place twin only when no older alias is read after it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from bridge.errors import LoweringError
    from bridge.pipeline.export.ops.inplace import _check_mutation_is_visible

    def fresh(x):
        y = x * 2
        y.div_(3)
        return y + 1

    def stale(x):
        y = x * 2
        view = y.view(-1)
        y.div_(3)
        return view + 1

    for fn, refused in ((fresh, False), (stale, True)):
        graph = make_fx(fn)(torch.randn(2, 3)).graph
        node = next(n for n in graph.nodes if n.target in (torch.ops.aten.div_.Scalar, torch.ops.aten.div_.Tensor))
        if refused:
            with pytest.raises(LoweringError, match="div_"):
                _check_mutation_is_visible(node)
        else:
            _check_mutation_is_visible(node)


@pytest.mark.iree
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "spatial"], ids=_case_id)
def test_compiled_loss_matches_onnxruntime(models, case):
    """Compiled by IREE (llvm-cpu), an MLIR compiler like onnx-mlir, the step trains as in onnxruntime."""
    model, loss, options, kind, _ = case
    tm = bridge.to_training_onnx(models[model][1], loss=loss, loss_options=options, optim="sgd", optim_options={"lr": 0.1})
    rng = np.random.default_rng(3)
    batches = [({"x": rng.standard_normal(MODELS[model][1]).astype(np.float32)}, _targets(kind, tm.target_shape, rng))
               for _ in range(2)]
    iree = bridge.compile(tm).session()
    ort = tm.session()
    assert_steps_match([iree.step(*b) for b in batches], [ort.step(*b) for b in batches])
