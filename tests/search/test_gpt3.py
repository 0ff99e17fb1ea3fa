"""A search on GPT-3 6.7B's shapes (Brown et al. 2020, Table 2.1; zoo gpt3-6.7b on the meta
device) on a100-1x8 runs to its budget and returns a plan that fits (issue 23: it stopped with
"op 'transpose_72': degrees = [2, 4, 1, 1]: degree 2 on dim 'sample'(8 / 8 micro-batches = 1)
does not divide it" after a reset to the 8-micro-batch pipeline baseline)."""

import pytest

from soapsearch import trace, zoo
from soapsearch.search import search


@pytest.mark.slow
def test_gpt3_6_7b_on_a100_1x8_runs_to_its_budget_and_fits():
    graph = trace(*zoo.build("gpt", "gpt3-6.7b", batch_size=8, device="meta"))
    r = search(graph, topology="a100-1x8", budget_s=None, proposals=300, workers=1, reset_every=25,
               optimizer="adam", precision="bf16", seed=0)
    assert r.proposals == 300 and not r.interrupted and r.exhaustive == 0
    assert r.baseline_plans["pipeline"].microbatches > 1  # a reset target of another count than the chains'
    assert r.result.fits and r.predicted_ms <= min(ms for name, ms in r.baselines.items()
                                                   if r.baseline_results[name].fits)
