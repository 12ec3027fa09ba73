"""Zoo, hand-built ONNX models: each converts with a loss and Adam, its first step matches an
independent torch twin, every float weight is trained, and its loss falls
(``zoo.harness.assert_loss_falls``: by 1 - LOSS_FALL within LOSS_STEPS steps)."""
from __future__ import annotations

import pytest
from zoo.handbuilt import CASES
from zoo.harness import check_case

# ``slow`` (make test and CI): the recurrent, embedding and depthwise models, the costliest (7-11 s
# each under load); their ops train in make test-fast through tests/test_op_db.py's rows.
SLOW = {"lstm_classifier", "bigru_regressor", "embedding_meanpool", "depthwise_dilated"}


@pytest.mark.parametrize("build", [pytest.param(b, marks=pytest.mark.slow if b.__name__ in SLOW else ())
                                   for b in CASES], ids=[b.__name__ for b in CASES])
def test_handbuilt_model_trains_like_its_torch_twin(build):
    check_case(build())
