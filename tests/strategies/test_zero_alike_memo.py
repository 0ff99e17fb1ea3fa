"""``alike_readers``' answers kept by what decides them (``strategies.zero_alike._decided``):
over a walk of moves (one op's config and level, whole-plan levels, FSDP units, micro-batch
counts under GPipe and 1F1B, an op's devices rotated: the same partitions on other devices or
in another order) through one lowering cache, the kept answer equals one found
afresh (``_classes``) at every step, and the walk both finds answers kept and finds new ones."""

from __future__ import annotations

import random
from dataclasses import replace

import strategies.zero_alike as zero_alike
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.baselines import sharded
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.schedule import chunk_of, device_passes
from strategies.zero import gather_groups
from tests.conftest import traced
from tests.search.delta_check import drawn_move


def _fresh(low):
    groups = gather_groups.__wrapped__(low)
    return zero_alike._classes(low, groups, chunk_of(low), device_passes(low)) if groups else ()


def test_kept_answers_equal_fresh_ones_on_a_walk():
    graph = traced("gpt", batch_size=16)
    n = 4
    spaces = {m: candidate_configs(graph, n, m, 2) for m in (1, 2)}
    weighted = [x.name for x in graph if any(w.trainable for w in x.weights)]
    rng = random.Random(7)
    current = sharded(data_parallel(graph, n), graph, 3)
    lowering_cache: dict = {}
    zero_alike._KEPT.clear()
    kept = found = 0
    kinds: dict[str, int] = {}
    for _ in range(80):
        if rng.random() < 0.3:
            op = rng.choice(weighted)
            pairs = [c for c in spaces[current.microbatches][op] if len(c.devices) == 2]
            cfg = current[op] if rng.random() < 0.5 or not pairs else rng.choice(pairs).with_memory(zero=3)
            shift = rng.randrange(1, n)
            proposal, kind = current.replace(op, replace(cfg, devices=tuple((d + shift) % n for d in cfg.devices))), "rotate"
        else:
            proposal, kind = drawn_move(rng, current, graph, spaces, weighted, (0.15, 0.25, 0.35, 0.4, 0.7), (2, 3))
        try:
            low = lower(graph, proposal, lowering_cache)
        except PlanError:
            continue
        before = len(zero_alike._KEPT), list(zero_alike._KEPT.values())
        got = zero_alike.alike_readers(low)
        assert got == _fresh(low), (kind, proposal.microbatches, proposal.schedule)
        if got:
            kept += any(got is v for v in before[1])
            found += not any(got is v for v in before[1])
        kinds[kind] = kinds.get(kind, 0) + 1
        if rng.random() < 0.6:
            current = proposal
    assert kept >= 10 and found >= 10, (kept, found)
    assert min(kinds.values()) >= 2 and len(kinds) == 6, kinds
