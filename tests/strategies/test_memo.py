"""``strategies.memo.per_lowered``: a lowering's derived facts computed once per lowering, and
the facts it keeps (ZeRO uses found per reader op, every device's run order, the prefetched
bytes) equal to a fresh computation on each lowering of a walk."""

from __future__ import annotations

import random

import pytest

import strategies.zero

from strategies import data_parallel, enumerate_configs
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.memo import per_lowered
from strategies.prefetch import gathered_bytes
from strategies.schedule import device_order
from strategies.zero import gather_groups, gather_uses, sharded_state
from strategies.zero_alike import alike_readers
from tests.conftest import traced


class _Lowered:
    """A stand-in for a ``Lowered``: any object a weak reference can follow."""
from tests.executor.plans import zero


def test_one_entry_by_identity():
    calls = []

    @per_lowered
    def f(x):
        calls.append(x)
        if x == "bad":
            raise ValueError(x)
        return [len(calls)]

    a, b = _Lowered(), _Lowered()
    first = f(a)
    assert f(a) is first and calls == [a]  # the same object: kept
    assert f(b) == [2]  # another object replaces the entry
    again = f(a)
    assert again == [3] and again is not first
    with pytest.raises(ValueError):
        f("bad")
    assert f(a) is again  # a call that raised replaced nothing
    assert len(calls) == 4


def test_kept_facts_equal_fresh_ones_on_a_walk():
    """zoo mlp on 4 devices, level 3 then one-op proposals: each lowering's kept facts are the
    functions' own (``__wrapped__``) on that lowering, and a new lowering gets new ones."""
    g = traced("mlp")
    plan = zero(3, data_parallel(g, 4), g)
    rng = random.Random(0)
    ops = [n.name for n in g if n.kind not in ("input", "parameter", "constant")]
    checked, last = 0, None
    for _ in range(12):
        op = rng.choice(ops)
        cfg = rng.choice(list(enumerate_configs(g[op], 4))).with_memory(zero=3)
        try:
            low = lower(g, plan.replace(op, cfg))
        except PlanError:
            continue
        kept = gather_uses(low)  # found again only for the ops whose partitions or shards changed
        strategies.zero._KEPT[:] = [None, {}]
        assert gather_uses.__wrapped__(low) == kept
        for fn in (gather_uses, gather_groups, sharded_state, device_order, alike_readers, gathered_bytes):
            assert fn(low) == fn.__wrapped__(low)
            assert fn(low) is fn(low)
        if last is not None:
            assert device_order(low) is not device_order(last) or low is last
        last, checked = low, checked + 1
    assert checked >= 6
    assert sum(gathered_bytes(last)) > 0  # level-3 gathers held on some device
