"""The weight shards and gradient buckets of a lowering through one cache (``strategies.lowering``
chains every weight's shards and splits them again only where they are not the last call's
objects) equal the ones found afresh, on a walk of one-op proposals lowered through one cache (as the
search's Evaluator does: each proposal after the last, the current plan moving on half the
time)."""

import dataclasses
import random

from strategies import data_parallel
from strategies.errors import PlanError
from strategies.lowering import lower
from tests.simulator.test_memory_delta import gpt_walk


def _walk(steps: int, seed: int):
    """(proposal, its lowering through one cache) of a gpt walk on 4 devices, buckets cut at 2 KiB
    (the traced gpt's ~40 weight shards, ~33 KB of data parallel gradients: 7 to 12 buckets)."""
    graph, candidates, ops, _ = gpt_walk()
    rng = random.Random(seed)
    current, cache = dataclasses.replace(data_parallel(graph, 4), bucket_cap_mb=2 / 1024), {}
    yield current, lower(graph, current, cache)
    for _ in range(steps):
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        try:
            low = lower(graph, proposal, cache)
        except PlanError:
            continue
        yield proposal, low
        if rng.random() < 0.5:
            current = proposal


def test_shards_and_buckets_through_a_cache_equal_fresh_ones_on_a_walk():
    compared, split = 0, set()
    for plan, low in _walk(150, 11):
        fresh = lower(low.graph, plan)
        assert low.weight_shards == fresh.weight_shards, plan
        assert low.gradient_sync == fresh.gradient_sync, plan
        compared += 1
        split.add(len(fresh.gradient_sync.buckets))
    assert compared > 100 and len(split) > 3  # bucket counts varied along the walk
