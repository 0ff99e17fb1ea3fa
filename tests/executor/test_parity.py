"""The executor's truth test (docs/design.md, "Executor"): after each of two steps with SGD (momentum)
and with Adam, the loss, every weight's gradient (gathered to a full tensor) and the whole
state_dict (weights, batchnorm running statistics) equal plain single-device PyTorch training
of the same model, float64, rtol 1e-7 (``harness.RTOL``). Every case of one world size runs in one launch.

The loss's sum is waited where its reduction's gates say (``strategies.lowering.gates``); the
cases cover each (test_recipe.py asserts which case takes which): STEP with a dynamic count
riding the gradient bucket (data parallel, every gradient divided after the bucket's
all-reduce: mlp, gpt, weighted ``dp``; gpt, alexnet ``owt``) or with a collective of its own
(mlp ``owt``: no replicated weight), STEP with a static count riding the bucket (mean MSE
``dp`` and ``dp_mb2``, summed cross-entropy ``dp_mb2`` and ``stages_dp``) or not (mean MSE
``loss_some`` on 4), BACKWARD (``dp_mb2``, ``random_mb2``,
the pipeline ``stages_dp``, ``loss_some`` on 4), and a loss partition alone (``gpipe``,
``loss_some`` on 2: rank 0 holds no loss partition); a loss that is not the output
(``scaled``) sums in its forward."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests
from tests.executor.models import SPEC as M  # losses the zoo lacks

pytestmark = pytest.mark.distributed


CASES_2 = [
    ("mlp", "dp"), ("mlp", "mp"), ("mlp", "owt"), ("mlp", "gpipe"), ("mlp", "1f1b"), ("mlp", "param"),
    ("mlp", "random1"), ("mlp", "random_mb2"),
    ("gpt", "dp"), ("gpt", "mp"), ("gpt", "owt"), ("gpt", "1f1b"), ("gpt", "param"), ("gpt", "random3"),
    ("alexnet", "dp"), ("alexnet", "mp"), ("alexnet", "owt"), ("alexnet", "spatial"), ("alexnet", "random6"),
    # batch 8: with 2 samples per micro-batch a 1x1 batchnorm's gradient is pure rounding noise
    ("resnet101", "dp"), ("resnet101", "spatial"), ("resnet101", "gpipe", 8), ("resnet101", "1f1b", 8),
    ("resnet101", "random5"),
    ("rnnlm", "dp"), ("rnnlm", "mp"), ("rnnlm", "1f1b"), ("rnnlm", "random4"),
    ("mlp", "dp_mb2"), ("mlp", "loss_some"), (M + "regression", "dp"), (M + "regression", "random1"),
    (M + "regression", "dp_mb2"), (M + "weighted", "dp"), (M + "weighted", "dp_mb2"), (M + "summed", "dp_mb2"), (M + "scaled", "dp"),
]
CASES_4 = [
    ("mlp", "dp"), ("mlp", "random11"), ("gpt", "owt"), ("gpt", "random12"), ("alexnet", "owt"),
    ("alexnet", "spatial"), ("resnet101", "dp"), ("rnnlm", "gpipe"),
    ("mlp", "loss_some"), ("mlp", "stages_dp"), (M + "regression", "loss_some"), (M + "weighted", "stages_dp"),
    (M + "summed", "stages_dp"),
    # batch 2 on 4 devices: data parallel 2 ways x tensor parallel 2 ways
    ("mlp", "hybrid", 2), ("gpt", "hybrid", 2), ("alexnet", "hybrid", 2),
]


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
