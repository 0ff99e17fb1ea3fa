"""Sharded weight state in the lowering (``ParallelConfig.zero``, ``strategies.zero``): each
shard's level is the largest ``zero`` of the ops reading its weight and 0 where one device holds
it; buckets are keyed by it; the chunking rule covers every element once; the cached lowering
equals ``lower_reference`` on walks that change levels; and a level that cannot run is one line."""

from __future__ import annotations

import random

import pytest
import torch

from soapsearch import trace
from strategies import Strategy, data_parallel, enumerate_configs
from strategies.config import ParallelConfig
from strategies.errors import PlanError
from strategies.lowering import lower, lower_reference
from strategies.prefetch import gathered_bytes
from strategies.zero import (chunk_numel, chunk_span, gather_groups, gather_uses, per_use_shards, shard_chunk_bytes,
                            sharded_state, zero_buckets)
from tests.conftest import traced
from tests.executor.plans import make_plan, zero
from tests.strategies.test_lowering import Tied
from tests.strategies.test_lowering_reference import _assert_equal

DEVICES = 4


@pytest.mark.parametrize("numel,n", [(10, 4), (8, 4), (3, 4), (1, 2), (4097, 3)])
def test_chunks_cover_the_flat_tensor_once(numel, n):
    spans = [chunk_span(numel, n, i) for i in range(n)]
    assert spans[0][0] == 0 and spans[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(hi - lo <= chunk_numel(numel, n) for lo, hi in spans)
    assert chunk_numel(numel, n) * n >= numel > chunk_numel(numel, n) * (n - 1) - (n - 1)


def test_data_parallel_levels_and_buckets():
    """zoo gpt data parallel on 4: at level 1 one bucket, every trainable byte in it, 1/4 of
    the flat bucket per device for the optimizer (the padded chunk), weights and gradients
    whole; at level 2 no bucket, each shard chunked on its own, gradients kept as chunks."""
    g = traced("gpt")
    base = lower(g, data_parallel(g, DEVICES))
    psi = base.device_bytes.trainable
    low = lower(g, zero(1, data_parallel(g, DEVICES), g))
    (key, b), = zero_buckets(low).items()
    assert key.zero == 1 and key.devices == (0, 1, 2, 3) and not per_use_shards(low)
    assert {s.zero for s in low.weight_shards if s.trainable} == {1}
    assert b.numel * 4 == psi[0]
    ss = sharded_state(low)
    assert ss.updated == ss.copies == (b.chunk * 4,) * DEVICES and ss.tensors == (1,) * DEVICES
    assert ss.weights == ss.gradients == psi and gathered_bytes(low) == (0,) * DEVICES
    assert low.device_bytes == base.device_bytes  # the weights themselves are held whole
    low = lower(g, zero(2, data_parallel(g, DEVICES), g))
    shards = per_use_shards(low)
    assert not zero_buckets(low) and {s.zero for s in shards} == {2} and len(shards) == len(low.weight_shards)
    chunks = sum(shard_chunk_bytes(s) for s in shards)
    ss = sharded_state(low)
    assert ss.updated == ss.copies == ss.gradients == (chunks,) * DEVICES and ss.weights == psi
    assert ss.tensors == (len(shards),) * DEVICES
    per_op: dict[str, int] = {}
    for u in gather_uses(low):  # data parallel: each op's weights, whole, one use per device
        per_op[u.op] = per_op.get(u.op, 0) + u.shard.nbytes
    assert gathered_bytes(low) == (max(per_op.values()),) * DEVICES  # level 2 prefetches nothing


def test_one_device_shards_are_level_0():
    """The megatron plan on 2 devices: the column- and row-parallel shards are held by one
    device each, so their level is 0 (nothing to shard); the norms' weights, on both, keep it."""
    g = traced("gpt")
    low = lower(g, zero(2, make_plan(g, "megatron", 2), g))
    single = [s for s in low.weight_shards if s.trainable and len(s.devices) == 1]
    assert single and all(s.zero == 0 for s in single)
    assert all(s.zero == 2 for s in low.weight_shards if s.trainable and len(s.devices) == 2)


def test_a_tied_weight_takes_the_largest_level_of_its_readers():
    graph = trace(Tied(), (torch.randn(4, 8),))
    plan = data_parallel(graph, 2)
    first = next(n.name for n in graph if n.weights)
    low = lower(graph, plan.replace(first, plan[first].with_memory(zero=1)))
    assert {s.zero for s in low.weight_shards} == {1}


def test_level_3_gathers_each_use_once_per_replica():
    """Data parallel zoo gpt at level 3: every trainable shard is gathered by each op reading
    it, one partition per replica; a chunk per shard."""
    g = traced("gpt")
    low = lower(g, zero(3, data_parallel(g, DEVICES), g))
    shards = per_use_shards(low)
    assert shards and all(s.zero == 3 for s in low.weight_shards if s.trainable)
    uses = gather_uses(low)
    assert {u.shard for u in uses} == set(shards)
    assert all(u.partitions == (0, 1, 2, 3) for u in uses)
    ss = sharded_state(low)
    chunks = sum(shard_chunk_bytes(s) for s in shards)
    assert ss.weights == ss.gradients == ss.updated == (chunks,) * DEVICES and ss.copies == (0,) * DEVICES
    assert ss.tensors == (len(shards),) * DEVICES


def test_a_use_reads_its_shards_as_one_group():
    """Data parallel zoo gpt at level 3: per reader op one group, of every level-3 shard it reads
    (a linear's weight and bias together), in ``weight_shards`` order; a member's chunk of the
    group is the sum of its chunks of the shards."""
    g = traced("gpt")
    low = lower(g, zero(3, data_parallel(g, DEVICES), g))
    groups, uses = gather_groups(low), gather_uses(low)
    assert [u.op for u in groups] == list(dict.fromkeys(u.op for u in uses))
    order = {s: i for i, s in enumerate(low.weight_shards)}
    for u in groups:
        assert u.shards == tuple(sorted((v.shard for v in uses if v.op == u.op), key=order.get))
        assert u.devices == (0, 1, 2, 3) and u.partitions == (0, 1, 2, 3)
        assert u.chunk_bytes == sum(shard_chunk_bytes(s) for s in u.shards)
        assert u.nbytes == sum(s.nbytes for s in u.shards)
    assert max(len(u.shards) for u in groups) == 2 and len(groups) < len(uses)


def test_a_weight_partly_replicated_is_refused_in_one_line():
    """Tied: one op reads the whole weight on device 0, the other is cut on out_features over
    devices 0 and 1: rows [0, 4) are held by device 0 alone, rows [4, 8) by both."""
    graph = trace(Tied(), (torch.randn(4, 8),))
    ops = [n.name for n in graph if n.weights]
    configs = {n.name: ParallelConfig((1,) * len(n.dims), (0,)) for n in graph}
    out = len(graph[ops[1]].output.shape) - 1
    configs[ops[1]] = ParallelConfig(tuple(2 if i == out else 1 for i in range(len(graph[ops[1]].dims))), (0, 1))
    plan = Strategy.of(configs, 2)
    lower(graph, plan)  # level 0: fine
    configs[ops[0]] = configs[ops[0]].with_memory(zero=1)
    with pytest.raises(PlanError, match=r"zero = 1: weight 'fc.weight' has regions held by one device .* and "
                                        r"regions replicated on several") as e:
        lower(graph, Strategy.of(configs, 2))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanError):
        lower_reference(graph, Strategy.of(configs, 2))


@pytest.mark.parametrize("name,microbatches", [("gpt", 1), ("mlp", 1), ("alexnet", 1)])
def test_the_cached_lowering_equals_the_reference_with_levels(name, microbatches):
    """Walks of one-op changes (a config or a level 0-3) through one cache: every lowering
    equals ``lower_reference``, or both refuse the plan with the same error; the cache goes on
    after a refusal."""
    graph = traced(name)
    rng = random.Random(name)
    configs = {node.name: list(enumerate_configs(node, DEVICES, microbatches)) for node in graph}
    weighted = [n.name for n in graph if any(w.trainable for w in n.weights)]
    cache: dict = {}
    plan = zero(1, data_parallel(graph, DEVICES), graph).with_microbatches(microbatches, "gpipe")
    sharded = refused = 0
    for _ in range(60):
        op = rng.choice(weighted)
        cfg = rng.choice(configs[op]) if rng.random() < 0.5 else plan[op]
        proposal = plan.replace(op, cfg.with_memory(zero=rng.choice((0, 1, 2, 3))))
        try:
            want = lower_reference(graph, proposal)
        except PlanError as e:
            with pytest.raises(PlanError, match=str(e).replace("(", r"\(").replace(")", r"\)")
                               .replace("[", r"\[").replace("]", r"\]")):
                lower(graph, proposal, cache)
            refused += 1
            continue
        _assert_equal(lower(graph, proposal, cache), want)
        sharded += bool(zero_buckets(want))
        if rng.random() < 0.6:
            plan = proposal
    assert sharded > 20


def test_a_per_use_weight_read_by_other_devices_per_op_is_refused_in_one_line():
    """Tied: the one weight read by the first op on devices 0, 1 and the second on 2, 3 (each
    data parallel): one shard over 0-3, fine at level 1 (one bucket), but at levels 2 and 3 a
    use of it would not pair up over its devices."""
    graph = trace(Tied(), (torch.randn(4, 8),))
    ops = [n.name for n in graph if n.weights]
    configs, second = {}, False
    for n in graph:  # graph order: from the second reader on, devices 2 and 3
        second = second or n.name == ops[1]
        devices = (2, 3) if second else (0, 1)
        s = n.sample_dim
        configs[n.name] = ParallelConfig(tuple(2 if i == s else 1 for i in range(len(n.dims))), devices)
    low = lower(graph, Strategy.of({k: c.with_memory(zero=1) if k in ops else c for k, c in configs.items()}, 4))
    assert [s.devices for s in low.weight_shards] == [(0, 1, 2, 3)]
    for level in (2, 3):
        plan = Strategy.of({k: c.with_memory(zero=level) if k in ops else c for k, c in configs.items()}, 4)
        for lowering in (lower, lower_reference):
            with pytest.raises(PlanError, match=rf"zero = {level}: weight 'fc.weight' region .* is read by "
                                                r"\{0: 1, 1: 1, 2: 0, 3: 0\} partitions of the op per replica") as e:
                lowering(graph, plan)
            assert "\n" not in str(e.value)
