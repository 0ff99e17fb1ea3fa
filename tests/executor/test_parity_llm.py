"""Parity (docs/design.md, "Executor") of the LLM ops and of tied weights: after each of two
steps of SGD (momentum) and Adam, in float64 on 2 and 4 gloo processes, the loss, every
gradient and the whole state_dict equal single-device training (``harness.compare``).

The zoo's tiny ``llama`` (RMSNorm, RoPE, SwiGLU, grouped-query SDPA) runs data parallel,
tensor parallel by heads (``heads``: attention cut on its heads, 2 of the 2 key/value heads'
groups on 4 processes, linears on out_features), as a pipeline and under random plans. The tied
models read one Parameter from two ops (GPT-2's ``lm_head.weight is wte.weight``; an embedding
read again through ``get_attr``): the plan holds it once and its gradient is the sum of both
uses, written back under both state_dict names. ``llm_ops`` runs the factory, index,
repeat_interleave, expand, triangle and masked-attention rules."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests
from tests.executor.models_llm import SPEC as T

pytestmark = pytest.mark.distributed


CASES_2 = [
    ("llama", "dp"), ("llama", "heads"), ("llama", "param"), ("llama", "gpipe"), ("llama", "1f1b"),
    ("llama", "random1"), ("llama", "random_mb2"),
    (T + "tied_gpt", "dp"), (T + "tied_gpt", "param"), (T + "tied_gpt", "mp"),
    (T + "tied_gpt", "random3"), (T + "tied_matmul", "dp"), (T + "tied_matmul", "mp"),
    (T + "tied_matmul", "random2"),
    (T + "llm_ops", "dp"), (T + "llm_ops", "heads"), (T + "llm_ops", "mp"), (T + "llm_ops", "random4"),
    (T + "llm_ops", "random_mb3"),
]
CASES_4 = [
    ("llama", "dp"), ("llama", "heads"), ("llama", "gpipe"), ("llama", "random7"),
    (T + "tied_gpt", "owt"), (T + "tied_gpt", "random12"), (T + "tied_matmul", "random5"),
    (T + "llm_ops", "heads"), (T + "llm_ops", "random9"),
]


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
