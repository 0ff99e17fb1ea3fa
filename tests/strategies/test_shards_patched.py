"""The lowering's weight shards patched in place per weight (``lowering_cache.Last.shards``), and
the gradient buckets split from them, equal the ones found afresh, on a walk of one-op proposals lowered through one cache (as the
search's Evaluator does: each proposal after the last, the current plan moving on half the
time)."""

import dataclasses
import random

from strategies import data_parallel
from strategies import lowering_cache
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


def test_patched_shards_equal_fresh_ones_on_a_walk(monkeypatch):
    spliced, chained = [], []
    real_replaced, real_shards = lowering_cache.Last._replaced, lowering_cache.Last.shards

    def replaced(self, name, old, new):
        spliced.append(self._start is not None and old is not None and new is not None
                       and len(old.shards) == len(new.shards))
        return real_replaced(self, name, old, new)

    def shards(self):
        chained.append(self._start is None)
        return real_shards(self)

    monkeypatch.setattr(lowering_cache.Last, "_replaced", replaced)
    monkeypatch.setattr(lowering_cache.Last, "shards", shards)
    compared = 0
    for plan, low in _walk(150, 11):
        n = len(chained), len(spliced)
        fresh = lower(low.graph, plan)  # its own Last: its calls not counted
        del chained[n[0]:], spliced[n[1]:]
        assert low.weight_shards == fresh.weight_shards, plan
        assert low.gradient_sync == fresh.gradient_sync, plan
        compared += 1
    assert compared > 100
    assert sum(spliced) > 50 and sum(chained) > 10  # both ways taken, most lowerings patched in place
    assert sum(chained) < len(chained) // 2
