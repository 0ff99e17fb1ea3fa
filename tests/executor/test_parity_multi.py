"""Parity (see test_parity.py) of attention the tracer takes apart: a nanoGPT whose fused qkv
Linear is cut by ``split`` / ``chunk`` into slice ops, and ``nn.MultiheadAttention`` traced op by
op (causal through SDPA; sequence first with dropout, computed explicitly). Plans: data
parallel, tensor parallel by heads (``heads``: the qkv Linear on out_features, attention on
heads; ``heads_proj`` also cuts the projections MultiheadAttention computes as matmuls), a
pipeline and random plans."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests
from tests.executor.models_multi import SPEC as M

pytestmark = pytest.mark.distributed

CASES_2 = [
    (M + "nanogpt_split", "dp"), (M + "nanogpt_split", "heads"), (M + "nanogpt_split", "gpipe"),
    (M + "nanogpt_split", "random1"), (M + "nanogpt_chunk", "heads"), (M + "nanogpt_chunk", "random2"),
    (M + "mha_causal", "dp"), (M + "mha_causal", "heads_proj"), (M + "mha_causal", "1f1b"),
    (M + "mha_causal", "random3"), (M + "mha_dropout", "dp"), (M + "mha_dropout", "heads_proj"),
    (M + "mha_dropout", "random4"),
]
CASES_4 = [
    (M + "nanogpt_split", "heads"), (M + "nanogpt_split", "random5"), (M + "mha_causal", "heads_proj"),
    (M + "mha_causal", "stages_dp"), (M + "mha_dropout", "heads_proj"), (M + "mha_dropout", "random6"),
]


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
