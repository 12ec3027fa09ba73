"""The benchmark generator (benchmarks/run.py) measures what it says, and rewrites only its own
section of benchmarks/RESULTS.md; the profiler (benchmarks/profile_step.py) sets bridge's step beside torch's;
benchmarks/profile_iree.py reads IREE's dispatch profile per step."""
from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import graph_size  # noqa: E402
import profile_iree  # noqa: E402
import profile_step  # noqa: E402
import run as bench  # noqa: E402
from models import MODELS  # noqa: E402


def test_the_generator_writes_its_section_from_one_run(tmp_path, monkeypatch, capsys):
    """One run on the mlp rewrites only the generated section of RESULTS.md: the header names the command and
    the load before and after, the step table has both backends and the ratio, the conversion table the
    weights (64*256 + 256*256 + 256*10 weights + biases: 0.3 MB)."""
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# Benchmark results\n\nkept intro\n\n{bench.BEGIN}\nold figures\n{bench.END}\n")
    monkeypatch.setattr(bench, "RESULTS", results)
    monkeypatch.setattr(bench, "RESULTS_JSON", tmp_path / "results.json")
    monkeypatch.setattr(bench, "PLOT", tmp_path / "step_time.png")
    argv = ["--models", "mlp", "--backends", "bridge-ort", "torch", "--sections", "step", "--rounds", "15",
            "--warmup", "0", "--burst", "1", "--settle", "0", "--max-load", "1000"]
    assert bench.main(argv) == 0
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nkept intro\n") and "old figures" not in text
    assert text.count(bench.BEGIN) == 1 and text.rstrip().endswith(bench.END)
    assert "python benchmarks/run.py " + " ".join(argv) in text
    assert re.search(r"Load average \(1 / 5 / 15 min\): [\d.]+ / [\d.]+ / [\d.]+ before the run, [\d.]+ / [\d.]+ / "
                     r"[\d.]+ after it", text)
    (measured,) = json.loads((tmp_path / "results.json").read_text())["results"]
    steps = text[text.index("### Step time, 2 threads"):]
    row = next(line for line in steps.splitlines() if line.startswith("| mlp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 4  # bridge-ort, torch, and the ratio
    assert cells[3] == f"{measured['steps']['bridge-ort']['ratio_to_torch']:.2f}"
    assert "| mlp | 0.3 |" in text
    assert "Step time, one thread" not in text  # no one-thread backend ran
    top = text[text.index("### All models"):text.index("### Step time")]
    assert f"| mlp | {measured['convert_s']:.2f} | {sum(measured['nodes'].values())} |" in top
    assert bench.BEGIN in capsys.readouterr().out


def test_the_conversion_child_also_writes_the_compiled_targets_graphs(tmp_path):
    """The compiled columns compile the graphs the conversion child converted with ``target="iree"`` and
    ``target="onnx-mlir"``: the graphs bridge converts for them, not the default one (their Convs as MatMuls)."""
    import bridge

    source = MODELS["small_cnn"]().export(tmp_path / "small_cnn.onnx")
    training = tmp_path / "small_cnn.train.onnx"
    figures = bench.fastest_conversion(source, training, 1, ["iree", "onnx-mlir"])
    assert figures["convert_s"] > 0
    for target in ("iree", "onnx-mlir"):
        written = onnx.load(str(bench.target_graph(training, target))).SerializeToString()
        assert written == bridge.to_training_onnx(str(source), loss="ce", optim="adam", optim_options={"lr": bench.LR},
                                                  target=target).model.SerializeToString()
        assert written != onnx.load(str(training)).SerializeToString()


def test_refuses_a_busy_machine(capsys, monkeypatch):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert bench.main(["--models", "mlp", "--max-load", "1.0"]) == 2
    assert "busy" in capsys.readouterr().out


def test_rounds_below_15_are_refused():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "5"])


def test_rewrites_only_its_own_section(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Data-parallel\n\nkept\n")
    monkeypatch.setattr(bench, "RESULTS", results)
    bench.write_results(f"{bench.BEGIN}\nfirst\n{bench.END}\n")
    bench.write_results(f"{bench.BEGIN}\nsecond\n{bench.END}\n")
    text = results.read_text()
    assert "kept" in text and "second" in text and "first" not in text and text.count(bench.BEGIN) == 1


def test_a_step_that_times_itself_is_timed_by_its_own_figure():
    """A child-process backend (ort-training) returns the step time it measured: that figure is
    recorded, not the parent's round trip; the other steps are timed by wall clock."""
    times = bench.measure({"child": lambda: 0.5, "local": lambda: {"loss": 1.0}}, rounds=15, warmup=1, settle=0)
    assert times["child"] == [0.5] * 15
    assert all(0 <= t < 0.5 for t in times["local"])


def test_settling_steps_are_not_timed(monkeypatch):
    """Each round runs untimed steps of a backend for ``settle`` seconds (at least one: right after another
    backend, whose threads may still hold the cores), then ``burst`` timed ones whose median is the round's."""
    calls = {"a": 0, "b": 0}

    def stepper(name, slow_first):
        def step():
            calls[name] += 1
            return 1.0 if slow_first and calls[name] % 3 == 1 else 0.25
        return step

    times = bench.measure({"a": stepper("a", True), "b": stepper("b", False)}, rounds=15, warmup=0, burst=2, settle=0)
    assert calls == {"a": 45, "b": 45}
    assert times == {"a": [0.25] * 15, "b": [0.25] * 15}
    clock = [0.0]  # a step takes 0.25 s of a fake clock: the machine's load cannot change the count

    def tick():
        clock[0] += 0.25

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    bench.measure({"a": tick}, rounds=1, warmup=0, burst=1, settle=1.0)
    assert clock[0] == 5 * 0.25, "settling runs steps for 1 s (4 steps), then the timed one"


def test_a_burst_of_no_step_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--burst", "0"])


def test_one_thread_backends_are_compared_with_torch_at_one_thread():
    """onnx-mlir runs on one thread: its ratio is to torch at one thread, in a table of its own, and a
    backend's ratio is the median of the per-round ratios, not the ratio of the medians."""
    times = {"torch": [1.0, 2.0, 4.0, 2.0, 4.0], "bridge-ort": [4.0, 1.0, 2.0, 1.0, 2.0],  # medians 2 and 2
             "torch@1": [2.0] * 5, "bridge-onnx-mlir": [1.0] * 5}
    summary = bench.summarise(times)
    assert summary["bridge-ort"]["ratio_to_torch"] == 0.5  # per round 4, 0.5, 0.5, 0.5, 0.5
    assert summary["bridge-onnx-mlir"]["ratio_to_torch"] == 0.5
    assert "ratio_to_torch" not in summary["torch"] and "ratio_to_torch" not in summary["torch@1"]
    result = {"model": "resnet18", "weights_mb": 42.7, "import_s": 2.5, "convert_s": 4.0, "peak_rss_mb": 1500,
              "import_rss_mb": 12, "iree_compile_s": 61.0, "onnx_mlir_compile_s": 33.0,
              "nodes": {"forward": 1, "loss": 2, "backward": 3, "optimizer": 4}, "steps": summary}
    info = {"date": "d", "cores": 2, "cpu": "x", "memory_gib": 8, "threads": 2, "versions": {"torch": "t"},
            "load_before": (0.5, 0.4, 0.3), "load_after": (1.5, 1.0, 0.5), "command": "c", "wall_s": 90,
            "convert_runs": 1}
    memory = [{"frozen": 5, "weights_mib": 384.0, "peak_mib": 1500.0, "import_mib": 540.0, "convert_s": 20.0,
               "total_s": 25.0}]
    text = bench.markdown([result], info, ["a note"], ["| mlp (85k) | 1 | 1000 | 1.00 | 1.0 ms | 0% | 0.1% |"], memory)
    two, one = text.index("### Step time, 2 threads"), text.index("### Step time, one thread")
    assert "| bridge-ort / torch |" in text[two:one] and "bridge-onnx-mlir" not in text[two:one]
    assert "| model | bridge-onnx-mlir ms | torch ms | bridge-onnx-mlir / torch |" in text[one:]
    assert "| resnet18 | 42.7 | 2.50 | 4.00 | 1500 (12) | 1 / 2 / 3 / 4 | 61.0 | 33.0 |" in text
    assert "0.50 / 0.40 / 0.30 before the run, 1.50 / 1.00 / 0.50 after it" in text
    assert "| 5 of 6 | 384 | 1500 | 960 MiB = 2.50x the weights | 20.0 | 25.0 |" in text
    assert "## Data-parallel" in text and "| mlp (85k) | 1 |" in text and "- a note" in text
    assert "exceeded the core count" not in text
    assert "exceeded the core count" in bench.markdown([result], {**info, "load_after": (9.0, 5.0, 3.0)}, [])


def test_the_top_table_has_a_row_per_model_with_ratios_to_torch_and_onnxsim():
    """The top table: conversion time, nodes and their ratio to onnxsim's, step ratios per backend (onnx-mlir's to
    torch at one thread), torch's step times, compile times, and each backend's step peak memory over torch's; a
    model without onnxsim's count or a compiled backend shows ``-`` there."""
    times = {"torch": [0.002] * 5, "bridge-ort": [0.001] * 5, "bridge-iree": [0.003] * 5,  # seconds
             "torch@1": [0.004] * 5, "bridge-onnx-mlir": [0.002] * 5}
    resnet = {"model": "resnet18", "weights_mb": 42.7, "import_s": 2.5, "convert_s": 1.25, "peak_rss_mb": 1500,
              "import_rss_mb": 12, "iree_compile_s": 61.0, "onnx_mlir_compile_s": 33.0,
              "nodes": {"forward": 100, "loss": 20, "backward": 300, "optimizer": 180},
              "onnxsim_nodes": {"forward": 100, "loss": 30, "backward": 220, "optimizer": 150},
              "steps": bench.summarise(times)}
    mlp = {**resnet, "model": "mlp", "convert_s": 0.5, "onnxsim_nodes": None,
           "steps": bench.summarise({"torch": [0.002] * 5, "bridge-ort": [0.001] * 5})}
    del mlp["iree_compile_s"], mlp["onnx_mlir_compile_s"]
    memory = [{"model": "resnet18", "backend": "torch", "memory": "-", "peak_mib": 40.0, "held_mib": 0.0},
              {"model": "resnet18", "backend": "bridge-ort", "memory": "default", "peak_mib": 50.0, "held_mib": 30.0},
              {"model": "resnet18", "backend": "bridge-ort", "memory": "min", "peak_mib": 20.0, "held_mib": 30.0},
              {"model": "resnet18", "backend": "bridge-onnx-mlir", "memory": "default", "peak_mib": 30.0, "held_mib": 10.0}]
    for row in memory:
        row.update(baseline_mib=500.0, footprint_mib=600.0, step_s=0.1)
    info = {"date": "d", "cores": 2, "cpu": "x", "memory_gib": 8, "threads": 2, "versions": {"torch": "t"},
            "load_before": (0.5, 0.4, 0.3), "load_after": (0.5, 0.4, 0.3), "command": "c", "wall_s": 90,
            "convert_runs": 3}
    text = bench.markdown([resnet, mlp], info, [], step_memory=memory)
    top = text[text.index("### All models"):text.index("### Step time")]
    assert "the fastest of 3 runs" in top
    rows = [line for line in top.splitlines() if line.startswith("|")]
    assert len(rows) == 4  # header, rule, two models
    assert rows[2] == ("| resnet18 | 1.25 | 600 (1.20x) | 0.50 / 1.50 / 0.50 | 2.0 / 4.0 | 61.0 / 33.0 | 40.0 / 40.0 "
                       "| 1.25 / - / 0.75 | 2.00 / - / 1.00 |")  # the step's peak; with what the session holds, over torch's
    assert rows[3] == "| mlp | 0.50 | 600 | 0.50 / - / - | 2.0 / - | - | - | - | - |"
    conversion = next(line for line in text.splitlines() if line.startswith("| resnet18 | 42.7 |"))
    assert "| 100 / 20 / 300 / 180 | 100 / 30 / 220 / 150 | 61.0 | 33.0 |" in conversion
    assert "### Step memory" in text and "| resnet18 | bridge-ort | min | 20.0 | 30.0 | 50.0 | 1.25 |" in text


def test_the_like_for_like_table_sets_bridges_frozen_batch_norm_counts_against_onnxsims():
    """Where onnxsim's step builds: bridge's nodes as converted, with BatchNorm frozen (onnxsim's form), and with
    BatchNorm frozen on the plain target, each over onnxsim's; a model without onnxsim's count has no row."""
    resnet = {"model": "resnet18", "nodes": {"forward": 100, "loss": 20, "backward": 300, "optimizer": 180},
              "onnxsim_nodes": {"forward": 100, "loss": 30, "backward": 220, "optimizer": 150},
              "frozen_nodes": {"onnxruntime": 550, "plain": 400}}
    mlp = {"model": "mlp", "nodes": {"forward": 8}, "onnxsim_nodes": None}
    rows = [line for line in bench.like_for_like_table([resnet, mlp]) if line.startswith("|")]
    assert rows[2:] == ["| resnet18 | 500 | 600 (1.20x) | 550 (1.10x) | 400 (0.80x) |"]
    assert bench.like_for_like_table([mlp]) == []


def test_the_frozen_batch_norm_counts_are_of_graphs_without_running_statistics(tmp_path):
    """The counted graphs are converted with BatchNorm frozen: fewer nodes than with batch statistics, on each target."""
    import bridge

    module = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2), torch.nn.Flatten())
    source = tmp_path / "bn.onnx"
    torch.onnx.export(module.eval(), (torch.randn(2, 1, 4, 4),), str(source), dynamo=False, input_names=["x"],
                      do_constant_folding=False)  # BatchNorm stays a node
    counts = bench.frozen_batch_norm_nodes(source)
    for target, nodes in counts.items():
        trained = bridge.to_training_onnx(str(source), loss="ce", optim="adam", target=target).model
        assert nodes < len(trained.graph.node)


def test_the_depth_slope_is_the_least_squares_line():
    """On an exact line the fit returns its slope and intercept; on points off a line, the least-squares ones
    (here (0, 0), (1, 1), (2, 0): slope 0, intercept the mean 1/3)."""
    blocks = [4, 8, 16, 32]
    slope, intercept = bench.fit_line(blocks, [0.75 + 0.125 * b for b in blocks])
    assert slope == pytest.approx(0.125) and intercept == pytest.approx(0.75)
    assert bench.fit_line([0, 1, 2], [0, 1, 0]) == pytest.approx((0.0, 1 / 3))
    rows = [{"stack": "resnet", "blocks": b, "convert_s": 0.75 + 0.125 * b, "convert_cpu_s": 1.0 + 0.25 * b,
             "nodes": 20 + 50 * b} for b in blocks]
    table = bench.depth_table(rows)
    assert table[0] == ("| model | 4 blocks | 8 blocks | 16 blocks | 32 blocks | s per block | intercept s | CPU s per "
                        "block | nodes per block |")
    assert table[2] == ("| resnet | 1.25 s (220) | 1.75 s (420) | 2.75 s (820) | 4.75 s (1620) | 0.125 | 0.75 | 0.250 "
                        "| 50 |")


@pytest.mark.slow
def test_the_depth_section_converts_each_depth_in_a_fresh_process(tmp_path, monkeypatch):
    """A real depth section on a resnet stack of 1 and 2 blocks: a row with both conversions, the deeper one with
    more nodes, and a slope."""
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bench, "RESULTS", results)
    monkeypatch.setattr(bench, "RESULTS_JSON", tmp_path / "results.json")
    assert bench.main(["--sections", "depth", "--stacks", "resnet", "--depths", "1", "2", "--max-load", "1000"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["depth"]
    assert [(r["stack"], r["blocks"]) for r in rows] == [("resnet", 1), ("resnet", 2)]
    assert all(r["convert_s"] > 0 and r["convert_cpu_s"] > 0 for r in rows) and rows[1]["nodes"] > rows[0]["nodes"]
    text = results.read_text()
    assert "## Conversion time vs depth" in text
    row = next(line for line in text.splitlines() if line.startswith("| resnet |"))
    assert len(row.strip("|").split("|")) == 7  # model, two depths, slope, intercept, CPU slope, nodes per block


def test_the_depth_section_needs_two_depths():
    with pytest.raises(SystemExit):
        bench.main(["--sections", "depth", "--depths", "8", "8"])


def test_bridge_kinds_and_torch_ops_meet_in_one_family():
    """A bridge node's kind (its source ONNX op) and torch's profiler op for the same layer share a row."""
    pairs = {"convolution": ("conv", "aten::mkldnn_convolution", "aten::convolution_backward"),
             "batch norm": ("batch_normalization", "aten::native_batch_norm", "aten::native_batch_norm_backward"),
             "pooling": ("max_pool", "average_pool", "aten::max_pool2d_with_indices", "aten::avg_pool2d_backward"),
             "matmul": ("gemm", "mat_mul", "aten::addmm", "aten::mm"),
             "activation": ("relu", "aten::threshold_backward", "aten::relu_")}
    for label, names in pairs.items():
        assert {profile_step.family(name) for name in names} == {label}, label
    assert profile_step.family("aten::add_") == profile_step.OTHER


def test_side_by_side_with_torch(capsys):
    assert profile_step.main(["mlp", "--torch", "--steps", "3", "--warmup", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("beside eager torch"):].splitlines()
    rows = {line[:32].strip(): line[32:].split() for line in table[2:] if line[:32].strip()}
    for row in ("optimizer", "matmul / forward", "matmul / backward", "all"):
        bridge_ms, torch_ms, _ = rows[row]
        assert float(bridge_ms) > 0 and float(torch_ms) > 0, row
    assert "conv" not in " ".join(rows)  # an MLP has no convolution on either side


def test_iree_dispatch_kinds_drop_number_shape_and_types():
    step = "bridge_training_step$async_"
    assert profile_iree.kind(step + "dispatch_441_matmul_512x4608x32_f32") == "matmul"
    assert profile_iree.kind(step + "dispatch_7_elementwise_transpose_8x64x16x16_f32xi1xf32") == "elementwise_transpose"
    assert profile_iree.kind(step + "dispatch_36_slow_memcpy") == "slow_memcpy"
    assert profile_iree.kind(step + "_encoding_22_encode_512x4608xf32_to_512x4608xf32") == "_encoding"


def test_iree_profile_tables_are_per_step():
    """Two profiled steps (the first dispatch ran twice): each dispatch's tile time and calls halved."""
    def group(key: str, count: int, ns: int) -> dict:
        return {"key": f"bridge_training_step$async_{key}", "count": count, "total_tile_duration_sum_ns": ns}

    groups = [group("dispatch_0_slow_memcpy", 2, 2_000_000), group("dispatch_1_matmul_8x8x8_f32", 4, 12_000_000),
              group("dispatch_2_matmul_4x4x4_f32", 2, 4_000_000), group("dispatch_3_elementwise_64_f32", 6, 2_000_000)]
    lines = profile_iree.tables(groups, top=2).splitlines()
    assert lines[0].startswith("tile time 10.0 ms per step, 7 dispatches per step")
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:] if line.strip()}
    assert rows["matmul"] == ["8.00", "80.0%", "3"]
    assert rows["elementwise"] == ["1.00", "10.0%", "3"]
    assert rows["dispatch_1_matmul_8x8x8_f32"] == ["6.00", "60.0%", "2"]
    assert "dispatch_3_elementwise_64_f32" not in rows  # beyond top=2


@pytest.mark.iree
def test_iree_profile_of_a_compiled_step(capsys):
    assert profile_iree.main(["mlp", "--threads", "1", "--steps", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "process_time" in out  # iree-benchmark-module's timing line
    kinds = out[out.index("by kind"):out.index("\ndispatches")].splitlines()[1:]
    shares = [float(line.split()[2].rstrip("%")) for line in kinds if line.strip()]
    assert "matmul" in " ".join(kinds) and abs(sum(shares) - 100) < 1


def test_graph_size_counts_every_node_once_per_phase_and_op(tmp_path):
    """The graph-size report's columns count every node of bridge's step once: its op rows add up to their phase's
    row, and the phases to the step's node count."""
    import bridge

    columns = graph_size.measure("mlp", ["plain"], None, tmp_path)
    model = bridge.to_training_onnx(str(tmp_path / "mlp.onnx"), loss="ce", optim="adam", target="plain").model
    counts = columns["bridge plain"]
    assert set(counts) == set(graph_size.PHASES)
    assert sum(sum(ops.values()) for ops in counts.values()) == len(model.graph.node)
    table = graph_size.markdown("mlp", columns, ops=True)
    for phase in graph_size.PHASES:
        rows = [int(line.split("|")[3]) for line in table if line.startswith(f"| {phase} |")]
        assert rows[-1] == sum(rows[:-1]) == sum(counts[phase].values())
    assert table[-2] == f"| total | | {len(model.graph.node)} |"


def test_graph_size_counts_frozen_batch_norm_when_asked(tmp_path):
    """``--batch-norm frozen`` counts the step converted with BatchNorm frozen: its forward computes no batch
    statistics, so of the default's reductions only the global pool's is left (resnet18: 20 BatchNorms, 1 pool)."""
    frozen = graph_size.measure("resnet18", ["plain"], None, tmp_path, batch_norm="frozen")["bridge plain"]
    trained = graph_size.measure("resnet18", ["plain"], None, tmp_path)["bridge plain"]
    assert trained["forward"]["ReduceMean"] > 20 and frozen["forward"]["ReduceMean"] == 1


def test_graph_size_kinds_split_each_phase_as_the_op_types_do(tmp_path):
    """``--kinds`` counts the same nodes per phase as the op rows, split by what each was emitted for."""
    import bridge

    by_op = graph_size.measure("mlp", ["plain"], None, tmp_path)["bridge plain"]
    model = bridge.to_training_onnx(str(tmp_path / "mlp.onnx"), loss="ce", optim="adam", target="plain").model
    by_kind = graph_size.bridge_counts(model, by="kind")
    assert {p: sum(k.values()) for p, k in by_kind.items()} == {p: sum(o.values()) for p, o in by_op.items()}
    assert graph_size.UNTAGGED not in {kind for kinds in by_kind.values() for kind in kinds}


def test_the_loss_given_to_onnxsim_is_torch_s_cross_entropy(tmp_path):
    """The model given to onnxsim (small_cnn with its loss appended, Constants and Flatten rewritten) computes
    ``F.cross_entropy`` of the module's logits, within float32 noise."""
    import onnxruntime
    import torch
    import torch.nn.functional as F

    model = MODELS["small_cnn"]()
    path = graph_size.with_loss(model, tmp_path / "small_cnn.loss.onnx")
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert not ops & {"Constant", "Flatten"}
    x = model.inputs["x"]
    onehot = np.eye(10, dtype=np.float32)[model.target]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (loss,) = session.run(None, {"x": x, "onehot": onehot})
    with torch.no_grad():
        logits = model.module.double().eval()(torch.from_numpy(x).double())
    want = F.cross_entropy(logits, torch.from_numpy(model.target))
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
