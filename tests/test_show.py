"""``bridge show``: the summary agrees with the file; the HTML picture is self-contained, has
one box per (phase, layer), and renders in a headless browser coloured by phase."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter

import numpy as np
import onnx
import pytest
from generated_docs import assert_generated_block_current
from helpers.models import gemm_mlp
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import bridge
from bridge.cli import main
from bridge.tools.show import PHASE_COLORS, summary, to_html


def _props(entries) -> dict[str, str]:
    return {e.key: e.value for e in entries}


@pytest.fixture(scope="module")
def gemm_adam(tmp_path_factory):
    tm = bridge.to_training_onnx(gemm_mlp()[0], loss="ce", optim="adam")
    return tm.save(tmp_path_factory.mktemp("show") / "train.onnx")


def test_summary_agrees_with_the_file(gemm_adam):
    raw = onnx.load(str(gemm_adam))
    text = summary(bridge.ir.load(gemm_adam))
    assert f"nodes: {len(raw.graph.node)}\n" in text
    for phase in ("forward", "loss", "backward", "optimizer"):
        ops = Counter(n.op_type for n in raw.graph.node if _props(n.metadata_props)["bridge.phase"] == phase)
        line = next(line for line in text.splitlines() if re.match(rf"  {phase} +\d+ ", line))
        assert int(line.split()[1]) == sum(ops.values())
        assert {op: n for op, n in re.findall(r"(\w+) (\d+)", line.split(None, 2)[2])} == {k: str(v) for k, v in ops.items()}
    for weight in ("W", "C"):
        line = next(line for line in text.splitlines() if line.strip().startswith(weight + " "))
        assert f"gradient grad_{weight}" in line and f"-> updated_{weight}" in line
        assert f"{weight}.exp_avg, {weight}.exp_avg_sq" in line
    for value in list(raw.graph.input) + list(raw.graph.output):
        role = _props(value.metadata_props)["bridge.role"]
        assert re.search(rf"^  {re.escape(value.name)} +{role} ", text, re.M), value.name


def test_html_is_self_contained_with_one_box_per_layer_and_phase(gemm_adam):
    raw = onnx.load(str(gemm_adam))
    page = to_html(bridge.ir.load(gemm_adam))
    assert "<script" not in page and "<link" not in page
    assert re.findall(r"(?:src|href)=", page) == []
    assert set(re.findall(r"https?://[^\"' ]+", page)) == {"http://www.w3.org/2000/svg"}
    groups = {(_props(n.metadata_props)["bridge.phase"], _props(n.metadata_props)["bridge.layer"]) for n in raw.graph.node}
    boxes = set(re.findall(r'<g class="box" data-phase="(\w+)" data-layer="([^"]*)">', page))
    assert boxes == groups
    for node in raw.graph.node:
        assert node.name.replace("&", "&amp;") in page


def test_cli_show_prints_the_summary_and_writes_html(gemm_adam, tmp_path, capsys):
    out = tmp_path / "graph.html"
    assert main(["show", str(gemm_adam), "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(summary(bridge.ir.load(gemm_adam))) and str(out) in printed
    assert out.read_text(encoding="utf-8") == to_html(bridge.ir.load(gemm_adam))


def _deep_mlp(depth: int) -> onnx.ModelProto:
    """``depth`` MatMul+Relu layers plus skip Adds every 4 layers: about ResNet-50's node count."""
    rng = np.random.default_rng(0)
    nodes, inits, current, skip = [], [], "x", "x"
    for i in range(depth):
        inits.append(numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), f"layer{i}.weight"))
        nodes.append(helper.make_node("MatMul", [current, f"layer{i}.weight"], [f"h{i}"], name=f"layer{i}.matmul"))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"], name=f"layer{i}.relu"))
        current = f"a{i}"
        if i % 4 == 3:
            nodes.append(helper.make_node("Add", [current, skip], [f"s{i}"], name=f"block{i // 4}.add"))
            current = skip = f"s{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"], name="out"))
    graph = helper.make_graph(
        nodes, "deep", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.slow
def test_resnet_sized_picture_renders_headless_coloured_by_phase(tmp_path):
    assert shutil.which("chromium"), "needs Debian's chromium: `make test` installs it (apt-get install chromium)"
    tm = bridge.to_training_onnx(_deep_mlp(48), loss="mse", optim="sgd")
    graph = bridge.ir.load(tm)
    n_nodes = sum(1 for _ in graph.nodes())
    page = tmp_path / "graph.html"
    page.write_text(to_html(graph), encoding="utf-8")
    height = int(re.search(r'<svg [^>]*height="(\d+)"', page.read_text()).group(1))
    width = int(re.search(r'<svg [^>]*width="(\d+)"', page.read_text()).group(1))
    groups = {(n.phase, n.layer) for n in graph.nodes()}
    assert n_nodes > 300 and page.read_text().count('<g class="box"') == len(groups) < n_nodes
    assert width < 1000 and height < 40 * (len(graph.layers("forward")) + 2), "one row per forward layer"
    shot = tmp_path / "graph.png"
    subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--window-size=1000,{height + 300}", f"--screenshot={shot}", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    colours = Counter(map(tuple, pixels))
    for phase, colour in PHASE_COLORS.items():
        rgb = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert colours[rgb] > 500, f"{phase} boxes are drawn in {colour}"


def test_show_sample_in_docs_is_current():
    """docs/ir.md's ``bridge show`` sample is rendered from a real conversion (docs/show_sample.py); the graph's
    hash is left out of the comparison: the sample's source model is a torch export, whose bytes vary by torch version."""
    assert_generated_block_current("show_sample.py", "ir.md", "render",
                                   normalize=lambda text: re.sub(r"sha256 [0-9a-f]+", "sha256 <hash>", text))
