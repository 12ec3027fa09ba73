"""Zoo, hand-built ONNX models: each converts with a loss and Adam, its first step matches an
independent torch twin, every float weight is trained, and its loss falls over 30 steps."""
from __future__ import annotations

import pytest

from zoo.handbuilt import CASES
from zoo.harness import check_case


@pytest.mark.parametrize("build", CASES, ids=[b.__name__ for b in CASES])
def test_handbuilt_model_trains_like_its_torch_twin(build):
    check_case(build())
