"""The test suite's own layout: shared test code lives in tests/helpers/ (or tests/zoo/), so no
test module reaches into another test module for a private helper."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _private_imports_from_test_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
            found += [f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_test_module_imports_a_private_helper_of_another():
    paths = sorted(TESTS.glob("test_*.py"))
    assert len(paths) > 40, "the glob is anchored on this file's folder"
    found = [hit for path in paths for hit in _private_imports_from_test_modules(path)]
    assert found == [], f"move these into tests/helpers/: {found}"


def test_an_xdist_group_is_in_the_node_id_the_scheduler_reads(request):
    """``--dist loadgroup`` keeps a group on one worker only if the group is in the test's node id
    (``...@group``): pytest-xdist 3.8 writes ``item._nodeid``, which pytest 9.2 ignores, so
    tests/conftest.py names it (without it both workers spawned test_distributed.py's ranks)."""
    from types import SimpleNamespace

    import conftest
    from xdist.scheduler.loadgroup import LoadGroupScheduling

    item, before = request.node, request.node.nodeid
    item.add_marker(pytest.mark.xdist_group("probe"))
    session = SimpleNamespace(config=SimpleNamespace(option=SimpleNamespace(loadgroup=True)), items=[item])
    try:
        conftest.pytest_collection_finish(session)
        assert item.nodeid.startswith(before) and LoadGroupScheduling._split_scope(None, item.nodeid) == "probe"
    finally:
        item.own_markers.pop()
        item._id = type(item._id).parse(before)


def test_onnxruntime_sessions_run_one_thread_unless_told(monkeypatch):
    """tests/conftest.py gives each xdist worker's onnxruntime sessions one intra-op thread, as its
    torch, but leaves a count a test sets."""
    import conftest
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    monkeypatch.setattr(ort.InferenceSession, "__init__", ort.InferenceSession.__init__)  # restored after
    conftest._one_onnxruntime_thread()
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    onnx.checker.check_model(model)
    assert ort.InferenceSession(model).get_session_options().intra_op_num_threads == 1
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    assert ort.InferenceSession(model, options).get_session_options().intra_op_num_threads == 2
