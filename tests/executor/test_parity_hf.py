"""Hugging Face models go in unchanged and train with parity: every family of ``soapsearch.hf``
(captured by torch.export where fx cannot trace it) on data parallel, a parameter split of its
linears (tensor parallel), a two-stage pipeline and random plans, one step on 2 and 4 gloo
processes against one device.

Tolerance: float32's (``harness.F32_RTOL``), not float64's. The models run in float64, but
transformers computes parts in float32 on purpose whatever the model's dtype: the loss
(``logits.float()`` in its ``ForCausalLMLoss``) and the rotary angles (``inv_freq.float() @
positions.float()``), so a sum split over devices rounds as float32 does (2^-24 ≈ 6e-8 per
term) in both runs. Adam then divides each gradient element by its own magnitude
(g/(|g|+ε) on the first step, Kingma and Ba 2015), so an element whose gradient is itself near
float32's rounding of the larger ones moves by up to the learning rate times that rounding,
and the next step's gradients and Adam moments carry it. A random plan may cut the loss on its
classes (vocab-parallel: each class shard's float32 max and sums, in another order than one
device; the rule equals F.cross_entropy in float32 to 3e-9 on gradients of 1.6e-2, as torch's own
float32 does against float64), after which one lm_head element of 3072 in Adam's state differs by
3.3e-5: ``ATOL`` = 1e-2·lr (lr = 0.01) bounds what float32-rounded gradients move a weight or a
moment over two steps, far below what a wrong shard or a missing term moves."""

from __future__ import annotations

import pytest

from soapsearch.hf import FAMILIES
from tests.executor.harness import F32_RTOL, HF_ATOL, compare, launch

pytest.importorskip("transformers")
ATOL = HF_ATOL
pytestmark = pytest.mark.distributed

PLANS = ("dp", "param", "gpipe", "random1")
CASES_2 = [(f"soapsearch.hf:{f}", PLANS[i % len(PLANS)]) for i, f in enumerate(FAMILIES)]
"""One plan per family, the plans taken in turn; test_parity_hf_every_plan runs them all."""
QUICK_2 = CASES_2[:len(PLANS)]
"""The first families, one of each plan: the README's test command (CI's time allows no more);
the slow test_parity_hf_2_processes runs every family."""
CASES_4 = [("soapsearch.hf:llama", "random2"), ("soapsearch.hf:gpt2", "param"),
           ("soapsearch.hf:bart", "dp")]
ALL_2 = [(f"soapsearch.hf:{f}", p) for f in FAMILIES for p in (*PLANS, "random2")]


def _check(cases: list[tuple], world: int) -> None:
    results = launch(cases, world)
    failed = []
    for i, (model, plan) in enumerate(cases):
        try:
            compare(model, results[i], rtol=F32_RTOL, atol=ATOL)
        except AssertionError as e:
            failed.append(f"{model} {plan}: {str(e).splitlines()[0]}")
    assert not failed, "\n".join(failed)


def test_parity_hf_each_plan_2_processes():
    _check(QUICK_2, 2)


@pytest.mark.slow
def test_parity_hf_2_processes():
    _check(CASES_2, 2)


@pytest.mark.slow
def test_parity_hf_4_processes():
    _check(CASES_4, 4)


@pytest.mark.slow
def test_parity_hf_every_plan():
    _check(ALL_2, 2)
