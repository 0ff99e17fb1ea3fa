"""Parity of the megatron baseline's flags (strategies/megatron.py): tensor parallel 2 ways
with the ops between the blocks cut on the samples (``megatron``) or on the sequence
(``megatron_sp``, Korthikanti et al. 2022; also on the gpt with Megatron-LM's fused
query-key-value linear, ``GPTConfig.fused_qkv``), and 2 pipeline stages of 2 ways each fed 2
micro-batches under 1F1B (``megatron_pp2``, 4 processes: T = 2, P = 2), llama 4 ways with 2
micro-batches of 2 samples (``megatron_tp4_sp_mb2``: its targets cut 2 samples × 2 sequence
halves, as the flattened loss reads them), on the zoo's gpt and
llama (rotary slices, grouped-query attention, SwiGLU) and Hugging Face's llama (captured by
torch.export), on 2 and 4 gloo processes, float64, SGD and Adam, against one device
(``harness.compare``; the Hugging Face model at float32's tolerance, test_parity_hf.py says
why)."""

from __future__ import annotations

import pytest

from soapsearch.executor import build_model
from strategies.lowering import lower
from tests.conftest import traced
from tests.executor.harness import F32_RTOL, HF_ATOL, compare, launch, parity_tests
from tests.executor.models_llm import SPEC
from tests.executor.plans import make_plan, partial_sources

pytestmark = pytest.mark.distributed

FUSED = SPEC + "fused_gpt"
"""The zoo gpt with Megatron-LM's fused query-key-value linear, cut over whole heads."""
CASES_2 = [("gpt", "megatron"), ("gpt", "megatron_sp"), ("llama", "megatron"), ("llama", "megatron_sp"),
           (FUSED, "megatron"), (FUSED, "megatron_sp")]
CASES_4 = [("gpt", "megatron_pp2"), ("gpt", "megatron_pp2_sp"), ("llama", "megatron_pp2"), ("llama", "megatron_sp"),
           ("llama", "megatron_tp4_sp_mb2")]  # 2 samples a micro-batch over 4 members: targets on samples x sequence
HF = "soapsearch.hf:llama"
HF_CASES = {2: [(HF, "megatron_sp")], 4: [(HF, "megatron_pp2")]}


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_plans_are_megatron_shaped(world, cases):
    """Each plan cuts row linears (their Partial sums are read) and, with _pp2, runs two stages on
    disjoint devices with 2 micro-batches."""
    for model, name in cases:
        g = traced(model) if ":" not in model else build_model(model, "tiny", device="meta").graph
        plan = make_plan(g, name, world)
        assert partial_sources(lower(g, plan)), (model, name)
        if model == FUSED:  # the fused linear column-parallel: one head a device
            assert plan["blocks_0_attn_qkv"].degrees[2] == 2 == plan["scaled_dot_product_attention"].degrees[1]
        if "_pp2" in name:
            first, last = plan[g.nodes[2].name].devices, plan[g.outputs[0]].devices
            assert plan.microbatches == 2 and not set(first) & set(last), (model, name)


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parity_hf_llama(world):
    pytest.importorskip("transformers")
    cases = HF_CASES[world]
    results = launch(cases, world)
    for i in range(len(cases)):
        # transformers computes the loss in float32: test_parity_hf.py's ATOL says why
        compare(HF, results[i], rtol=F32_RTOL, atol=HF_ATOL)
