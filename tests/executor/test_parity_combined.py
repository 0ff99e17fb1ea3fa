"""Parity of plans that combine the memory choices (docs/design.md, "Sharded state (ZeRO /
FSDP)", "Recompute"): sharded weight state at each level with recompute per block and per MLP,
with tensor cuts and pipeline stages, on 2 and 4 gloo processes, float64, SGD and Adam, against
one device (``harness.compare``). A level-3 weight read by a recomputed op is gathered for the
recomputation as for its backward."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests

pytestmark = pytest.mark.distributed

CASES_2 = [("gpt", "zero3_dp+rc_blocks"), ("gpt", "zero1_megatron+rc_blocks"), ("gpt", "zero2_dp_mb2+rc_mlp")]
CASES_4 = [("gpt", "zero3_megatron+rc_attn"), ("gpt", "zero3_megatron_pp2+rc_blocks")]

results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
test_parity_4_processes = pytest.mark.slow(test_parity_4_processes)  # the README's test command stays within CI's time; `pytest -m slow` runs them
