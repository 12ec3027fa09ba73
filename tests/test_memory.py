"""``memory="min"``: the backward recomputes cheap forward values; the step's results stay the same bit for bit,
and fewer bytes of forward values stay alive into the backward. benchmarks/step_memory.py's measurement."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import bridge
from bridge.cli import main
from bridge.contract import LAYER, MEMORY, PHASE, Phase, props
from bridge.errors import InvalidOptionError
from bridge.tools.target_check import onnx_mlir_missing
from tests.helpers.reference import bridge_steps, random_batches

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import step_memory  # noqa: E402


class _Block(torch.nn.Module):
    """Conv-BatchNorm-ReLU-Conv-BatchNorm plus the input, then ReLU: a residual block, whose output the next
    block's recomputation starts from."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


def _cnn() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                 torch.nn.MaxPool2d(2), _Block(8), _Block(8), torch.nn.AdaptiveAvgPool2d(1),
                                 torch.nn.Flatten(), torch.nn.Linear(8, 5))
    return module, torch.randn(4, 3, 16, 16)


def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                 torch.nn.Dropout(0.25), torch.nn.Linear(32, 5))
    return module, torch.randn(6, 12)


def _value_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of every intermediate value of ``model`` (its shapes inferred, all static)."""
    sizes = {}
    for value in onnx.shape_inference.infer_shapes(model).graph.value_info:
        tensor = value.type.tensor_type
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize
        sizes[value.name] = int(np.prod([d.dim_value for d in tensor.shape.dim])) * itemsize
    return sizes


def _saved_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the forward values (forward and loss nodes' outputs) that a backward or optimizer node reads:
    what stays alive from the forward into the backward."""
    sizes = _value_bytes(model)
    phases = {}
    for node in model.graph.node:
        phase = {p.key: p.value for p in node.metadata_props}[PHASE]
        phases.update({out: phase for out in node.output})
    read_later = {name for node in model.graph.node
                  if {p.key: p.value for p in node.metadata_props}[PHASE] not in (Phase.FORWARD, Phase.LOSS)
                  for name in node.input}
    return sum(sizes.get(name, 0) for name, phase in phases.items()
               if phase in (Phase.FORWARD, Phase.LOSS) and name in read_later)


@pytest.mark.parametrize("build", [_cnn, _mlp], ids=["cnn", "mlp"])
def test_min_memory_steps_are_bit_identical(build):
    module, x = build()
    default = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x)
    low = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x, memory="min")
    batches = random_batches(default, 3, classes=5)
    sessions = [tm.session(seed=0) for tm in (default, low)]
    for inputs, target in batches:
        want, got = (session.step(inputs, target) for session in sessions)
        assert sorted(got) == sorted(want)
        for name in want:  # loss, every grad_<w>, every updated_<state>
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert _saved_bytes(low.model) < _saved_bytes(default.model)


def test_min_memory_recomputes_in_the_backward():
    """The recomputed nodes are backward nodes of a forward layer (tags kept); the forward may lose nodes whose
    only readers the backward now recomputes for itself; the eval graph is untouched."""
    module, x = _cnn()
    default = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x)
    low = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x, memory="min")

    def per_phase(model):
        counts: dict[str, int] = {}
        for node in model.graph.node:
            tags = {p.key: p.value for p in node.metadata_props}
            counts[tags[PHASE]] = counts.get(tags[PHASE], 0) + 1
            assert tags[LAYER] or tags[PHASE] != Phase.BACKWARD or node.op_type == "Identity"
        return counts

    before, after = per_phase(default.model), per_phase(low.model)
    assert after[Phase.FORWARD] <= before[Phase.FORWARD] and after[Phase.BACKWARD] > before[Phase.BACKWARD]
    assert onnx.printer.to_text(low.eval_model.graph) == onnx.printer.to_text(default.eval_model.graph)
    batches = random_batches(default, 2, classes=5)
    for want, got in zip(bridge_steps(default, batches), bridge_steps(low, batches), strict=True):
        np.testing.assert_array_equal(got["loss"], want["loss"])


def test_memory_option_is_checked():
    module, x = _mlp()
    with pytest.raises(InvalidOptionError, match="memory='low'"):
        bridge.to_training_onnx(module, example_inputs=x, memory="low")


def _mlp_graph(tmp_path: Path, batch: int, hidden: int = 1) -> list[str]:
    """An mlp's training graph (``hidden`` 512x512 layers) at ``batch`` saved for benchmarks/step_memory.py; its
    child arguments."""
    torch.manual_seed(2)
    layers = [torch.nn.Linear(64, 512), torch.nn.ReLU()]
    for _ in range(hidden - 1):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    module = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    tm = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=torch.randn(batch, 64))
    graph = tmp_path / f"mlp{batch}x{hidden}.onnx"
    tm.save(graph)
    np.savez(str(graph) + ".state.npz", **tm.initial_state())
    inputs, target = random_batches(tm, 1, classes=10)[0]
    data = tmp_path / f"mlp{batch}x{hidden}.data.npz"
    np.savez(data, **inputs, target=target)
    return ["--model", "mlp", "--data", str(data), "--threads", "1", "--graph", str(graph)]


@pytest.mark.slow
def test_step_memory_grows_with_the_batch(tmp_path):
    """The tool's measurement (a fresh process, one warm-up step, the peak of the next above the baseline) is
    positive and grows with the batch: 8 vs 4096 rows of 512 activations (8 MiB each)."""
    small, large = (step_memory.run_child([*_mlp_graph(tmp_path, batch), "--backend", "bridge-ort"])
                    for batch in (8, 4096))
    assert 0 < small["peak_mib"] < large["peak_mib"]
    assert large["peak_mib"] - small["peak_mib"] > 8  # at least one [4096, 512] float32 activation more


def _nodes(model: onnx.ModelProto) -> list[tuple[str, list[str]]]:
    return [(node.op_type, list(node.input)) for node in model.graph.node]


def test_compiled_rows_compile_the_graph_converted_for_their_compiler(tmp_path, monkeypatch):
    """benchmarks/step_memory.py compiles, for each compiled backend, the graph converted for that compiler
    (``target=``, as docs/onnx-mlir.md tells a user to), not the default graph it saves beside it."""
    compiled: dict[str, onnx.ModelProto] = {}

    class Compiled:
        def save(self, path):
            Path(path).write_bytes(b"")

    def record(graph, backend, **options):
        compiled[backend] = onnx.load(str(graph))
        return Compiled()

    monkeypatch.setattr(bridge, "compile", record)
    notes: list[str] = []
    default = step_memory.prepare(step_memory.MODELS["small_cnn"](), tmp_path, "default", ["bridge-iree", "bridge-onnx-mlir"],
                                  notes)
    assert not notes and set(compiled) == {"iree", "onnx-mlir"}
    for target, graph in compiled.items():
        converted = bridge.to_training_onnx(tmp_path / "small_cnn.onnx", loss="ce", optim="adam",
                                            optim_options={"lr": step_memory.LR}, target=target).model
        assert _nodes(graph) == _nodes(converted)
    assert _nodes(compiled["onnx-mlir"]) != _nodes(onnx.load(str(default)))


def _adam_heavy_step(tmp_path: Path, backend: str) -> tuple[float, dict]:
    """A step whose state (weights and Adam's two moments, 3 x 9 MiB) dwarfs its batch, measured by the tool
    for ``backend``: the state's MiB and the figures."""
    arguments = _mlp_graph(tmp_path, 8, hidden=10)
    state_mib = sum(value.nbytes for value in np.load(arguments[-1] + ".state.npz").values()) / 2**20
    assert state_mib > 25
    return state_mib, step_memory.run_child([*arguments, "--backend", backend])


@pytest.mark.slow
def test_a_step_of_a_swapped_session_allocates_no_state(tmp_path):
    """bridge-ort-arena, as bridge.Trainer runs it (the updated state written into the session's second set of
    buffers): its steps add far less than the state; a new copy of the state would add all of it. The second
    set is memory the session holds between steps: the tool counts it as held."""
    state_mib, figures = _adam_heavy_step(tmp_path, "bridge-ort-arena")
    assert 0 < figures["peak_mib"] < state_mib / 2
    assert figures["footprint_mib"] > 2 * state_mib  # the state and its second set of buffers, resident
    assert figures["held_mib"] > state_mib / 2  # the second set: in the RSS between steps, beyond the state


@pytest.mark.slow
def test_an_in_place_step_replaces_the_state_in_its_memory(tmp_path):
    """bridge-ort-in-place, ``TrainingSession(in_place=True)``: at its peak the step holds the gradients (a third of
    Adam's state) and the new state of a piece, not a whole new state beside the old (4/3 of the state with the
    gradients): under 2/3 of the state; between steps the session holds no second set (under half the state)."""
    state_mib, figures = _adam_heavy_step(tmp_path, "bridge-ort-in-place")
    assert 0 < figures["peak_mib"] < 2 / 3 * state_mib
    assert figures["held_mib"] < state_mib / 2


def test_cli_memory_flag(tmp_path):
    out = tmp_path / "train.onnx"
    assert main(["convert", "examples/models/mlp.onnx", "--loss", "ce", "--memory", "min", "-o", str(out)]) == 0
    assert props(onnx.load(out).metadata_props)[MEMORY] == "min"  # what bridge's sessions read


@pytest.mark.parametrize("build", [_cnn, _mlp], ids=["cnn", "mlp"])
def test_steps_without_memory_pattern_are_bit_identical(build, monkeypatch):
    """bridge's sessions run without onnxruntime's memory pattern and buffer reuse (``session_options``): the same
    steps, bit for bit, as with them."""
    from bridge.training import runtime

    module, x = build()
    tm = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x)
    options = runtime.session_options()
    assert not options.enable_mem_pattern and not options.enable_mem_reuse
    ours = runtime.TrainingSession(tm.model, tm.initial_state(), seed=0)
    bridge_options = runtime.session_options

    def with_pattern(*args, **kwargs):
        options = bridge_options(*args, **kwargs)
        options.enable_mem_pattern = options.enable_mem_reuse = True
        return options

    monkeypatch.setattr(runtime, "session_options", with_pattern)
    theirs = runtime.TrainingSession(tm.model, tm.initial_state(), seed=0)
    for inputs, target in random_batches(tm, 3, classes=5):
        want, got = theirs.step(inputs, target), ours.step(inputs, target)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


_VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}  # a view of its input in onnx-mlir: no copy
_COPIES = {"Slice", "Gather", "Transpose", *_VIEWS}  # nodes that only move values: cheap to make where they are read


def _live_peak(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> int:
    """The most bytes of node outputs alive at once when ``nodes`` run in that order, each output freed after its
    last reader (onnx-mlir allocates and frees in program order); a view (``_VIEWS``) keeps its input alive."""
    sizes = _value_bytes(model)
    root = {node.output[0]: node.input[0] for node in nodes if node.op_type in _VIEWS}
    while any(source in root for source in root.values()):
        root = {view: root.get(source, source) for view, source in root.items()}
    last = {root.get(name, name): index for index, node in enumerate(nodes) for name in [*node.input, *node.output]}
    live: dict[str, int] = {}
    peak = 0
    for index, node in enumerate(nodes):
        live.update({name: sizes.get(name, 0) for name in node.output if name not in root})
        peak = max(peak, sum(live.values()))
        for name in [name for name in live if last[name] <= index]:
            del live[name]
    return peak


def _copies_at_their_readers(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each ``_COPIES`` node moved to just before its first reader in the same phase (the last
    node first, so that a moved reader takes its producers along)."""
    order = list(nodes)
    for node in reversed(nodes):
        at = order.index(node)
        readers = [index for index, other in enumerate(order) if set(node.output) & set(other.input)]
        phase = props(node.metadata_props)[PHASE]
        if node.op_type in _COPIES and readers and all(props(other.metadata_props)[PHASE] == phase
                                                       for other in order[at:min(readers)]):
            order.insert(min(readers) - 1, order.pop(at))
    return order


@pytest.mark.parametrize("target", ["onnx-mlir", "iree"])
def test_copies_are_made_where_they_are_read(target):
    """A target whose convolutions are im2col MatMuls (``dense_conv_as_matmul``): no Slice, Gather, Transpose or
    view is made earlier than its first reader needs it at the cost of memory: moving each to just before that
    reader does not lower the step's peak of live bytes in graph order, the order in which onnx-mlir allocates and
    frees. The input gradient's per-offset slices of its columns are each made just before they are added back."""
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(16 * 8 * 8, 5))
    model = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=torch.randn(4, 3, 8, 8),
                                    target=target).model
    nodes = list(model.graph.node)
    assert _live_peak(model, nodes) <= _live_peak(model, _copies_at_their_readers(nodes))


def _pooled_cnn() -> tuple[torch.nn.Module, torch.Tensor]:
    """benchmarks/models.py's small_cnn at a quarter of its plane: RGB stem, ReLU, MaxPool, Conv, ReLU, AvgPool, Linear."""
    torch.manual_seed(4)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                 torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AvgPool2d(2),
                                 torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))
    return module, torch.randn(8, 3, 16, 16)


def test_onnx_mlir_conv_columns_add_at_most_one_conv_tensor_to_the_peak():
    """The onnx-mlir target runs every Conv as im2col MatMuls, whose columns are ``K`` times the Conv's input: in graph
    order (in which onnx-mlir allocates and frees) its step's live peak is at most the plain graph's, whose Convs make
    no columns, plus the largest input or output of one Conv: the columns are made a part at a time, none larger."""
    module, x = _pooled_cnn()
    plain, compiled = (bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x, target=target).model
                       for target in ("plain", "onnx-mlir"))
    sizes = _value_bytes(plain)
    largest = max(sizes.get(name, 0) for node in plain.graph.node if node.op_type == "Conv"
                  for name in (node.input[0], node.output[0]))
    assert largest > 0
    assert _live_peak(compiled, list(compiled.graph.node)) <= _live_peak(plain, list(plain.graph.node)) + largest


@pytest.mark.slow
@pytest.mark.onnx_mlir
@pytest.mark.skipif(onnx_mlir_missing() is not None, reason="onnx-mlir is not available (ONNX_MLIR_HOME or PATH)")
def test_onnx_mlir_small_cnn_step_peak_is_within_one_and_a_half_torchs(tmp_path):
    """benchmarks/step_memory.py's measurement of small_cnn (its im2col columns set the step's peak before they were
    made a part at a time): the onnx-mlir step's peak above its baseline is at most 1.5 times eager torch's."""
    notes: list[str] = []
    rows = step_memory.measure_model("small_cnn", ["torch", "bridge-onnx-mlir"], ["default"], 1, tmp_path, notes)
    assert not notes
    peaks = {row["backend"]: row["peak_mib"] for row in rows}
    assert 0 < peaks["bridge-onnx-mlir"] <= 1.5 * peaks["torch"]


class _MlpHalf(torch.nn.Module):
    """A transformer's MLP half as BERT's: LayerNorm, Linear, GELU (exported as Div, Erf, Add, Mul, Mul), Linear,
    the residual, LayerNorm; then a classifier on the mean over the sequence."""

    def __init__(self, width: int = 32, classes: int = 5):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        x = self.norm1(x)
        return self.head(self.norm2(x + self.down(torch.nn.functional.gelu(self.up(x)))).mean(1))


def _torch_saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors eager torch keeps for its backward (each storage once, parameters excluded)."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        torch.nn.functional.cross_entropy(module(x), torch.zeros(len(x), dtype=torch.long)).backward()
    return sum(saved.values())


@pytest.mark.parametrize("target", ["onnxruntime", "onnx-mlir"])
def test_forward_values_kept_for_the_backward_are_no_more_than_torchs(target, monkeypatch):
    """The graph converted for onnxruntime or onnx-mlir (``recompute_from_kept``) keeps no more bytes of forward values
    for the backward than eager torch keeps for the same module, where GELU and LayerNorm are single ops: the values
    the exported formulas add (x / sqrt(2), the GELU's output, the normalized input) are recomputed in the backward
    from values kept anyway. Its steps are those of the graph without the form, bit for bit."""
    from bridge.pipeline import targets

    torch.manual_seed(4)
    module, x = _MlpHalf(), torch.randn(8, 16, 32)
    tm = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x, target=target)
    assert _saved_bytes(tm.model) <= _torch_saved_bytes(module, x)
    monkeypatch.setitem(targets.TARGETS, target, targets.TARGETS[target] - {"recompute_from_kept"})
    without = bridge.to_training_onnx(module, loss="ce", optim="adam", example_inputs=x, target=target)
    batches = random_batches(tm, 3, classes=5)
    for want, got in zip(bridge_steps(without, batches), bridge_steps(tm, batches), strict=True):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
