"""Parity of full recompute (``rc_layers``: every layer but its closing residual add) on the zoo
gpt with Megatron-LM's fused query-key-value linear, with and without sequence parallelism, on 2
and 4 gloo processes against one device: the row-parallel linears' reductions of partial sums
and the all-gathers are called again at the recomputation (docs/design.md, "Recompute")."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests
from tests.executor.models_llm import SPEC

pytestmark = pytest.mark.distributed

FUSED = SPEC + "fused_gpt"
CASES_2 = [(FUSED, "megatron+rc_layers"), (FUSED, "megatron_sp+rc_layers")]
CASES_4 = [(FUSED, "megatron_sp+rc_layers"), (FUSED, "megatron_pp2+rc_layers")]

results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
