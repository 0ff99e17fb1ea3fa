"""Sharded state on a search's walk: one-op moves (each with a drawn ZeRO level), whole-plan
level moves (0–3), prefetch-unit and bucket-cap changes and micro-batch counts. At every plan
the figures the ZeRO passes derive from a lowering, walked on reading orders once per class
(``strategies.zero_alike``) and summed per device set (``strategies.zero.sharded_state``),
equal each device's own walk over its whole run order and a per-shard sum, and delta
simulation equals a full simulation; none of the kept facts is stale."""

from __future__ import annotations

import random

import simulator.zero3
import strategies.prefetch
import strategies.zero
import strategies.zero_alike
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.baselines import sharded
from strategies.prefetch import gathered_bytes, issue_positions, step_units
from strategies.zero import (ShardedState, gather_groups, gather_uses, per_use_shards, shard_chunk_bytes,
                             sharded_state, zero_buckets)
from strategies.zero_alike import alike_readers
from tests.conftest import traced
from tests.search.delta_check import checked_lowering, drawn_move
from tests.strategies.test_zero_alike import _per_device  # each device's own walk over its whole run order


def _issuers(low, classes) -> dict:
    """(device, step reading level-3 weights) -> the step whose start issues its all-gathers
    (``issue_positions`` on ``classes``' orders, each member's own partition indices)."""
    groups = gather_groups(low)
    out = {}
    for c in classes:
        flags = [any(groups[g].zero == 3 for g in gs) for gs in c.reads]
        at = issue_positions(flags, step_units(low, c.order))
        for d, ks in zip(c.devices, c.indices):
            for q, p in enumerate(at):
                if flags[q]:
                    out[(d, c.order[q]._replace(index=ks[q]))] = c.order[p]._replace(index=ks[p])
    return out


def _state_per_shard(low) -> ShardedState:
    """``ShardedState`` summed shard by shard on each member, as ZeRO's table 1 counts it."""
    n = low.strategy.num_devices
    trainable, tensors = low.device_bytes.trainable, low.gradient_sync.tensors
    updated, weights, gradients = list(trainable), list(trainable), list(trainable)
    copies, count, leaves = [0] * n, list(tensors), set()
    for b in zero_buckets(low).values():
        for d in b.key.devices:
            updated[d] += b.chunk_bytes - sum(s.nbytes for s in b.shards)
            copies[d] += b.chunk_bytes
            count[d] += 1
            leaves.update((d, s.name) for s in b.shards)
    for s in per_use_shards(low):
        c = shard_chunk_bytes(s)
        for d in s.devices:
            updated[d] += c - s.nbytes
            gradients[d] += c - s.nbytes
            if s.zero == 3:
                weights[d] += c - s.nbytes
            else:
                copies[d] += c
            count[d] += 1
            leaves.add((d, s.name))
    for d, _ in leaves:
        count[d] -= 1
    return ShardedState(*map(tuple, (updated, count, copies, weights, gradients)))


def test_zero_passes_and_delta_equal_fresh_ones_on_a_walk(monkeypatch):
    graph = traced("gpt", batch_size=16)  # repeated blocks: fsdp_unit "block" has units of several steps
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    n = topo.num_devices
    evaluate = Evaluator(graph, topo, cost)
    spaces = {m: candidate_configs(graph, n, m, topo.node_size) for m in (1, 2)}
    weighted = [x.name for x in graph if any(w.trainable for w in x.weights)]
    rng = random.Random(5)
    current = sharded(data_parallel(graph, n), graph, 3).with_fsdp_unit("block")
    kinds = dict.fromkeys(("op", "level", "unit", "bucket", "count"), 0)
    coarser = 0
    for _ in range(28):
        proposal, kind = drawn_move(rng, current, graph, spaces, weighted, (0.12, 0.27, 0.37, 0.45, 0.7), (0, 2, 3))
        low = checked_lowering(evaluate, proposal, (kind, proposal.microbatches, proposal.fsdp_unit))
        if low is None:
            continue
        kept = {fn.__name__: fn(low) for fn in (gather_uses, gather_groups, sharded_state, alike_readers,
                                                gathered_bytes)}
        strategies.zero._KEPT[:] = [None, {}]  # gather_uses' per-op memo, emptied: every fact found afresh
        strategies.zero_alike._KEPT.clear()  # alike_readers' answers by what decides them, emptied
        for fn in (gather_uses, gather_groups, sharded_state, alike_readers, gathered_bytes):
            assert fn.__wrapped__(low) == kept[fn.__name__], (fn.__name__, kind)
        classes, each = alike_readers(low), _per_device(low)
        assert _issuers(low, classes) == _issuers(low, each)
        assert kept["sharded_state"] == _state_per_shard(low)
        with monkeypatch.context() as m:  # every device's own walk over its whole run order
            for module in (strategies.prefetch, simulator.zero3):
                m.setattr(module, "alike_readers", lambda _: each)
            assert gathered_bytes.__wrapped__(low) == kept["gathered_bytes"]
        coarser += len(classes) < len(each)
        kinds[kind] += 1
        if rng.random() < 0.6:
            current = proposal
    assert min(kinds.values()) >= 2, kinds
    assert coarser >= 5  # the reading orders join devices whose run orders differ elsewhere
