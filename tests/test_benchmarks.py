"""The step-time benchmark (benchmarks/run.py) measures what it says, and rewrites only its own
section of benchmarks/RESULTS.md; the profiler (benchmarks/profile_step.py) sets bridge's step beside torch's."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import profile_step  # noqa: E402
import run as bench  # noqa: E402


@pytest.mark.slow
def test_mlp_side_by_side(capsys):
    assert bench.main(["--models", "mlp", "--backends", "bridge-ort", "torch", "--rounds", "15",
                       "--max-load", "1000", "--no-write"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| mlp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 4 and float(cells[3]) > 0  # bridge-ort, torch, and the ratio
    assert "| mlp | 0.3 |" in out  # 64*256 + 256*256 + 256*10 weights (+ biases): 0.3 MB


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


def test_settling_steps_are_not_timed():
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
    sleeps = []
    bench.measure({"a": lambda: sleeps.append(time.sleep(0.01))}, rounds=1, warmup=0, burst=1, settle=0.05)
    assert len(sleeps) >= 6, "settling runs steps for 0.05 s before the timed one"


def test_a_burst_of_no_step_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--burst", "0"])


def test_graph_sizes_show_the_first_landing_next_to_now():
    result = {"model": "resnet18", "weights_mb": 42.7, "import_s": 2.5, "convert_s": 4.0, "peak_rss_mb": 1500,
              "import_rss_mb": 550,
              "nodes": {"forward": 1, "loss": 2, "backward": 3, "optimizer": 4},
              "steps": {"torch": {"median_ms": 1.0, "q1_ms": 1.0, "q3_ms": 1.0, "ratio_to_torch": 1.0}}}
    info = {"date": "d", "cores": 2, "cpu": "x", "threads": 2, "load_before": 0.5, "python": "3", "torch": "t",
            "onnxruntime": "o", "command": "c"}
    text = bench.markdown([result], info, ["resnet18: ort-training skipped: no --ort-training-python"])
    assert f"| 1 / 2 / 3 / 4 | {bench.BEFORE_NODES['resnet18']} |" in text
    assert "| model | weights MB | import s | convert s |" in text and "| resnet18 | 42.7 | 2.50 | 4.00 |" in text
    assert "- resnet18: ort-training skipped" in text


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
