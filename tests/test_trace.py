"""The tracer's speed-ups keep the graph: the optimizer update traced once per kind of weight (once for every
shape: it is elementwise) and replayed, bridge's lowerings traced once per call signature and replayed
(arguments keyed by type and value; constants they capture captured again), BatchNorm's forward and backward
traced once per shape and replayed (its running statistics once for every channel count), views of fake tensors
at static shapes made by ATen's meta kernel, the eval step traced only when its graph is asked for."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

import bridge
import bridge.api
import bridge.pipeline.importer.ops.normalization
import bridge.pipeline.lowering
import bridge.pipeline.lowering.conv
import bridge.pipeline.optimizers
import bridge.pipeline.replay
import bridge.pipeline.trace
from bridge.pipeline.replay import replayed


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> str:
    """Six weights of three kinds (shape and dtype): [8, 6]; [8, 8] twice; [8] three times."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 8))
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    torch.onnx.export(module, (torch.randn(4, 6),), str(path), dynamo=False, input_names=["x"], output_names=["y"])
    return str(path)


def _convert(path: str, optim: str, monkeypatch, replay: bool) -> tuple[bridge.TrainingModel, int]:
    """The conversion and how many times the optimizer's rule was traced; ``replay=False``: every weight traced."""
    calls = []
    update = bridge.pipeline.optimizers.Optimizer.update
    with monkeypatch.context() as patch:
        patch.setattr(bridge.pipeline.optimizers.Optimizer, "update", lambda self, *args: calls.append(1) or update(self, *args))
        if not replay:
            patch.setattr(bridge.pipeline.trace._UpdateReplay, "update", lambda self, *args: self.optimizer.update(*args))
        tm = bridge.to_training_onnx(path, loss="mse", optim=optim, clip_grad_norm=1.0)
    return tm, len(calls)


@pytest.mark.parametrize("optim", ["adam", "nadam"])  # nadam: a 0-d state slot beside the weight-shaped ones
def test_update_traced_once_per_kind_of_weight_same_graph(mlp_path, monkeypatch, optim):
    replayed, traced = _convert(mlp_path, optim, monkeypatch, replay=True)
    assert traced == 1, "the elementwise update is traced once for the weights of every shape, not once per weight"
    every, traced = _convert(mlp_path, optim, monkeypatch, replay=False)
    assert traced == 6
    for part in ("model", "update_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory) -> str:
    """Three convolutions; the last two have one signature (shapes, dtypes, arguments), the first another (its
    input is data: no input gradient)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(64, 3))
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    torch.onnx.export(module, (torch.randn(2, 2, 4, 4),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"])
    return str(path)


def _convert_counting_conv_backward(path: str, monkeypatch, replay: bool) -> tuple[bridge.TrainingModel, int]:
    """Convert ``path`` (ce + adam), counting the calls of the convolution backward's lowering; without
    ``replay`` every call is traced."""
    backward = torch.ops.aten.convolution_backward.default
    bridge.pipeline.lowering.import_all_lowerings()
    lowering = bridge.pipeline.trace.LOWERINGS[backward]
    calls = []
    with monkeypatch.context() as patch:
        patch.setitem(bridge.pipeline.trace.LOWERINGS, backward, lambda *args: calls.append(1) or lowering(*args))
        if not replay:
            patch.setattr(bridge.pipeline.trace._LoweringReplay, "_lower", lambda self, op, fn, *args, **kw: fn(*args, **kw))
        return bridge.to_training_onnx(path, loss="ce", optim="adam"), len(calls)


def test_lowering_traced_once_per_signature_same_graph(cnn_path, monkeypatch):
    replayed, traced = _convert_counting_conv_backward(cnn_path, monkeypatch, replay=True)
    assert traced == 2, "the convolution backward is traced once per signature, not once per convolution"
    every, traced = _convert_counting_conv_backward(cnn_path, monkeypatch, replay=False)
    assert traced == 3
    for part in ("model", "gradient_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"


@pytest.fixture(scope="module")
def select_cnn_path(tmp_path_factory) -> str:
    """Three convolutions on a 2x2 plane; the last two have one signature, and their input gradient is the
    ``gemm_select`` form, whose lowering captures a constant (the selection matrix)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 64, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(256, 3))
    path = tmp_path_factory.mktemp("select_cnn") / "select_cnn.onnx"
    torch.onnx.export(module, (torch.randn(2, 2, 2, 2),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"])
    return str(path)


def test_lowering_with_a_constant_replayed_same_graph(select_cnn_path, monkeypatch):
    """A lowering region that captures a constant is replayed too, each replay capturing it under its own
    attribute, as tracing the call again would: the same graph, initializers included."""
    monkeypatch.setattr(bridge.pipeline.targets, "conv_input_grad_form", lambda *args: "gemm_select")
    monkeypatch.setattr(bridge.pipeline.targets, "conv_forward_form", lambda *args: "conv")  # no selection constants forward
    monkeypatch.setattr(bridge.pipeline.targets, "conv_weight_grad_form", lambda *args: "conv")  # nor gather indices
    replayed, traced = _convert_counting_conv_backward(select_cnn_path, monkeypatch, replay=True)
    assert traced == 2, "a lowering that captures a constant is still traced once per signature"
    every, traced = _convert_counting_conv_backward(select_cnn_path, monkeypatch, replay=False)
    assert traced == 3
    constants = [t.name for t in every.model.graph.initializer if t.name.startswith("_tensor_constant")]
    assert len(constants) == 2, constants  # one selection matrix per input gradient
    for part in ("model", "gradient_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"


def _view_facts(make: Callable[[], tuple]) -> tuple:
    """What ``make()`` gives in a fresh fake mode with an empty dispatch cache: the view's size, strides, offset
    and whether it shares its base's storage, or the error's type and message."""
    FakeTensorMode.cache_clear()
    with FakeTensorMode():
        try:
            base, view = make()
        except (RuntimeError, ValueError) as error:
            return type(error), str(error)
        return (tuple(view.shape), view.stride(), view.storage_offset(),
                view.untyped_storage()._cdata == base.untyped_storage()._cdata)


@pytest.mark.parametrize("case", ["flatten", "inferred", "offset", "strided", "other size", "two inferred",
                                  "not viewable", "unsafe"])
def test_static_views_are_the_views_torchs_rule_makes(case):
    """Within ``static_views_on_meta_kernels``, a view of a fake tensor at static shapes has the size, strides,
    offset and storage torch's own rule gives it, and a view that cannot be made raises torch's error."""
    aten = torch.ops.aten
    cases = {
        "flatten": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x, [6, 20])),
        "inferred": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x, [-1, 5])),
        "offset": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(aten.select.int(x, 0, 1), [3, 20])),
        "strided": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x.permute(0, 2, 1, 3), [2, 4, 3, 5])),
        "other size": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x, [7, -1])),
        "two inferred": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x, [-1, -1])),
        "not viewable": lambda: (x := torch.empty(2, 3, 4, 5), aten.view.default(x.permute(0, 2, 1, 3), [8, 15])),
        "unsafe": lambda: (x := torch.empty(2, 3, 4, 5), aten._unsafe_view.default(x, [2, 60])),
    }
    torchs = _view_facts(cases[case])
    with bridge.pipeline.trace.static_views_on_meta_kernels():
        ours = _view_facts(cases[case])
    assert ours == torchs


def test_views_keep_torchs_rule_at_symbolic_shapes_and_after_the_context():
    """A view at symbolic sizes within the context is torch's (symbolic) view; after it, torch's rule is back."""
    from torch._subclasses import fake_impls
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    rule = fake_impls.op_implementations_dict[torch.ops.aten.view.default]
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.empty(4, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    with pytest.raises(KeyError), bridge.pipeline.trace.static_views_on_meta_kernels(), mode:
        view = torch.ops.aten.view.default(x, [-1])
        assert str(view.shape[0]) == f"3*{x.shape[0]}"
        raise KeyError("leaves the context by an error")
    assert fake_impls.op_implementations_dict[torch.ops.aten.view.default] is rule


def test_views_on_meta_kernels_same_graph(cnn_path, monkeypatch):
    """The conversion's graphs are the ones torch's view rule gives (each conversion from an empty fake-tensor
    dispatch cache, which would otherwise hand back the other's views)."""
    FakeTensorMode.cache_clear()
    ours = bridge.to_training_onnx(cnn_path, loss="ce", optim="adam")
    FakeTensorMode.cache_clear()
    for module in (bridge.api, bridge.pipeline.trace):
        monkeypatch.setattr(module, "static_views_on_meta_kernels", contextlib.nullcontext)
    torchs = bridge.to_training_onnx(cnn_path, loss="ce", optim="adam")
    for part in ("model", "gradient_model"):
        assert getattr(ours, part).graph == getattr(torchs, part).graph, f"{part}: the graph differs"


def test_conversion_traces_the_step_once(mlp_path, monkeypatch, tmp_path):
    """The eval step is traced when its graph is first asked for (then kept), not by the conversion."""
    calls = []
    trace = bridge.pipeline.trace.trace_eval_step
    monkeypatch.setattr(bridge.api, "trace_eval_step", lambda *args: calls.append(1) or trace(*args))
    tm = bridge.to_training_onnx(mlp_path, loss="mse", optim="sgd")
    assert calls == []
    assert tm.eval_model.graph.name == "bridge_eval_step"
    tm.save(tmp_path / "mlp.onnx")
    assert calls == [1]


def test_lowering_replay_keys_arguments_by_typed_value():
    """A lowering call is replayed only for arguments equal in type and value (``0.0`` is not ``-0.0``, ``True`` is
    not ``1``, a list is not a tuple); an argument of another kind (here an object) is traced at every call."""
    seen = []

    def lowering(x, value):
        seen.append(value)
        return torch.ops.aten.mul.Tensor(x, 2.0)

    marker = object()
    values = [0.0, 0.0, -0.0, 1, 1, True, [1, 2], [1, 2], (1, 2), torch.float32, torch.float32, torch.float64,
              marker, marker, None, None]
    replay = bridge.pipeline.trace._LoweringReplay()

    def f(x):
        for value in values:
            x = replay._lower(torch.ops.aten.add.Tensor, lowering, x, value)
        return x

    graph = make_fx(f, tracing_mode="fake")(torch.randn(3))
    assert seen == [0.0, -0.0, 1, True, [1, 2], (1, 2), torch.float32, torch.float64, marker, marker, None]
    assert [math.copysign(1.0, seen[0]), math.copysign(1.0, seen[1])] == [1.0, -1.0]
    muls = [n for n in graph.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert len(muls) == len(values), "a replayed call still adds its ops to the graph"


def _exported_batch_norms(module: torch.nn.Sequential, path) -> str:
    """``module`` (input [3, 2, 5, 5]) exported in training mode to ``path``, each BatchNorm's scale and bias
    drawn distinct (the exporter de-duplicates equal initializers)."""
    for norm in (m for m in module if isinstance(m, torch.nn.BatchNorm2d)):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
        torch.nn.init.uniform_(norm.bias, -0.5, 0.5)
    torch.onnx.export(module.eval(), (torch.randn(3, 2, 5, 5),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return str(path)


@pytest.fixture(scope="module")
def bn_path(tmp_path_factory) -> str:
    """Three BatchNorms: the last two on one shape (3x3 planes: Conv forwards, not ``conv_forward_gemm``'s
    MatMul, whose transposed output and gradients would key separate traces), the first on another."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                 torch.nn.Linear(36, 3))
    return _exported_batch_norms(module, tmp_path_factory.mktemp("bn") / "bn.onnx")


@pytest.mark.parametrize("dynamic", [False, True])
def test_batch_norm_traced_once_per_shape_same_graph(bn_path, monkeypatch, dynamic):
    """BatchNorm's forward and backward are traced once per shape and replayed (bridge.pipeline.replay.replayed), at a
    static batch; at a symbolic batch every call is traced."""
    norm = bridge.pipeline.importer.ops.normalization

    def convert(replay: bool) -> tuple[bridge.TrainingModel, dict[str, int]]:
        calls = {"forward": 0, "backward": 0}
        with monkeypatch.context() as patch:
            for part in calls:
                fn = getattr(norm, f"_batch_norm_{part}")
                patch.setattr(norm, f"_batch_norm_{part}",
                              lambda *args, _fn=fn, _part=part: calls.__setitem__(_part, calls[_part] + 1) or _fn(*args))
            if not replay:
                patch.setattr(norm, "replayed", lambda fn, *args, **_: fn(*args))
            tm = bridge.to_training_onnx(bn_path, loss="ce", optim="adam", dynamic_batch=dynamic)
        return tm, calls

    replayed, calls = convert(replay=True)
    every, every_calls = convert(replay=False)
    assert every_calls["backward"] == 3
    assert calls["backward"] == (3 if dynamic else 2), "the backward is traced once per shape"
    # the example run (fake tensors, no trace) calls it once per shape too (bridge.pipeline.replay._fake_run); the trace
    # once per shape at a static batch, every time at a symbolic one
    assert calls["forward"] == every_calls["forward"] - (1 if dynamic else 2)
    for part in ("model", "gradient_model", "eval_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"


@pytest.fixture(scope="module")
def channels_path(tmp_path_factory) -> str:
    """Two BatchNorms of different channel counts (4, 6) over the same number of values per channel (3x5x5)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                 torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.Flatten(),
                                 torch.nn.Linear(150, 3))
    return _exported_batch_norms(module, tmp_path_factory.mktemp("channels") / "channels.onnx")


def test_running_statistics_traced_once_for_every_channel_count_same_graph(channels_path, monkeypatch):
    """BatchNorm's running-statistics update is elementwise over [C]: traced once for BatchNorms of any channel
    count with the same momentum and values per channel, and replayed (bridge.pipeline.replay.replayed, pointwise=True)."""
    norm = bridge.pipeline.importer.ops.normalization

    def convert(replay: bool) -> tuple[bridge.TrainingModel, int]:
        traced = []
        fn = norm._running_statistics
        with monkeypatch.context() as patch:
            patch.setattr(norm, "_running_statistics",
                          lambda *args: (get_proxy_mode() is not None and traced.append(1)) or fn(*args))
            if not replay:
                patch.setattr(norm, "replayed", lambda fn, *args, **_: fn(*args))
            tm = bridge.to_training_onnx(channels_path, loss="ce", optim="adam")
        return tm, len(traced)

    replayed, traced = convert(replay=True)
    every, every_traced = convert(replay=False)
    assert every_traced == 2
    assert traced == 1, "the running statistics of both channel counts are one trace, replayed"
    for part in ("model", "gradient_model", "eval_model"):
        assert getattr(replayed, part).graph == getattr(every, part).graph, f"{part}: the replayed graph differs"


def test_replayed_in_a_fake_run_reuses_the_result_layout():
    """Outside tracing, in a fake-tensor run (the conversion's example run), ``replayed`` runs ``fn`` once per key
    and gives later calls fresh tensors of its result's layout; a result sharing an argument's storage is not
    reused, and outside a fake run ``fn`` always runs."""
    calls = []

    def fn(x, y):
        calls.append("fn")
        return (x * y).t(), None  # a view of a new tensor: its strides are kept

    def alias(x, y):
        calls.append("alias")
        return x[1:]

    with FakeTensorMode():
        x, y = torch.empty(2, 3), torch.empty(2, 3)
        first, second = replayed(fn, x, y), replayed(fn, x, y)
        replayed(fn, torch.empty(3, 3), torch.empty(3, 3))
        assert calls == ["fn", "fn"], "fn runs once per key"
        assert second[1] is None and second[0] is not first[0]
        assert isinstance(second[0], FakeTensor)
        assert (second[0].shape, second[0].stride(), second[0].dtype) == (first[0].shape, first[0].stride(),
                                                                           first[0].dtype)
        assert replayed(alias, x, y)._base is x and replayed(alias, x, y)._base is x
        assert calls.count("alias") == 2
    replayed(fn, torch.ones(2, 3), torch.ones(2, 3))
    assert calls.count("fn") == 3


def _pointwise_graph(fn, replay: bool, grads: tuple | None = None) -> tuple[list, int]:
    """``fn(x, g, s)`` on two weights ``x`` of different shapes, each with its gradient ``g`` (contiguous ones of
    those shapes by default; any layout given in ``grads``), and a 0-d ``s``, traced by make_fx (through
    ``Replay.run_pointwise`` when ``replay``): each node's op, arguments (by position), value shape and strides, and
    how many times ``fn`` ran."""
    calls = []

    def step(a, b, grad_a, grad_b, s):
        regions = bridge.pipeline.replay.Replay()
        run = (lambda x, g: regions.run_pointwise("update", [x, g, s], lambda: calls.append(1) or fn(x, g, s))) \
            if replay else (lambda x, g: fn(x, g, s))
        return run(a, grad_a), run(b, grad_b)

    grads = grads or (torch.randn(3, 4), torch.randn(5))
    weights = [torch.randn(grad.shape) for grad in grads]
    graph = make_fx(step, tracing_mode="fake")(*weights, *grads, torch.tensor(0.5)).graph
    index = {node: i for i, node in enumerate(graph.nodes)}
    nodes = [(node.op, str(node.target), torch.fx.node.map_arg(node.args, lambda n: index[n]),
              (tuple(node.meta["val"].shape), node.meta["val"].stride())
              if isinstance(node.meta.get("val"), torch.Tensor) else None)
             for node in graph.nodes]
    return nodes, len(calls)


def test_pointwise_replay_resizes_elementwise_regions_and_keys_others_by_shape():
    """An elementwise region is traced once for tensors of every shape and replayed at the call's shape (every
    value of the copy has it); a region with a reduction is traced once per shape. Both give the graph that
    tracing every call gives."""
    elementwise = lambda x, g, s: torch.sqrt(x * g + s) * (s * 2)  # noqa: E731
    reduction = lambda x, g, s: x - torch.sum(g) * s  # noqa: E731
    for fn, traced in ((elementwise, 1), (reduction, 2)):
        replayed, calls = _pointwise_graph(fn, replay=True)
        assert calls == traced
        assert replayed == _pointwise_graph(fn, replay=False)[0]


def test_pointwise_replay_resizes_permuted_gradients_with_their_layout():
    """A gradient that is a permuted view (a Conv weight gradient's last Transpose): an elementwise region over it
    is traced once for every shape without unit dims and replayed with each value in the order of dims tracing
    gives it; with a unit dim (where strides do not fix that order) once per shape."""
    def update(x, g, s):
        m = g * s + x  # a permuted operand first: the result takes its order
        return x - s * torch.sqrt(m * m + g), m

    permuted = lambda *sizes: torch.randn(*reversed(sizes)).permute(*reversed(range(len(sizes))))  # noqa: E731
    for grads, traced in (((permuted(2, 3, 4), permuted(5, 6, 7)), 1), ((permuted(2, 1, 4), permuted(5, 1, 7)), 2)):
        replayed, calls = _pointwise_graph(update, replay=True, grads=grads)
        assert calls == traced
        assert replayed == _pointwise_graph(update, replay=False, grads=grads)[0]
