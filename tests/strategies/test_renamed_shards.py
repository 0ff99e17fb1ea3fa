"""A weight's shards renamed from its reader's twin (``lowering_cache.Last._renamed``) only while
the lowering cache's entry by shape is still that twin's: a bounded cache (``LoweringCache.trim``)
drops it, and another op of the shape may hold the key since; the shards then come from the
reader's own pieces."""

from __future__ import annotations

from strategies.lowering import lower
from strategies.lowering_cache import _weight_shards
from strategies.megatron import megatron
from tests.conftest import traced


def test_renamed_shards_only_from_the_twins_entry():
    graph = traced("gpt", "small")
    plan = megatron(graph, 8, tp=4, pp=1, microbatches=2)
    cache: dict = {}
    lower(graph, plan, cache)
    last = cache[("last", plan.microbatches, plan.num_devices, None)]
    op, other, name = "blocks_1_mlp_fc", "blocks_1_attn_proj", "blocks.1.mlp.fc.weight"
    assert last.twins[op][0] == "blocks_0_mlp_fc"
    read_by = (last.by_op[op],)
    renamed = last._renamed(name, read_by, cache)
    own = _weight_shards(name, read_by, plan.num_devices)
    assert renamed.shards == own.shards and (renamed.per_device == own.per_device).all()
    key = last.shaped[op]
    cache[key] = cache[last.shaped[other]]  # another op's pieces under the key since
    assert last._renamed(name, read_by, cache) is None
    del cache[key]  # trimmed
    assert last._renamed(name, read_by, cache) is None
