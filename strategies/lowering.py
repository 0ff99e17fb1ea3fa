"""The lowering: (OpGraph, Strategy) -> every partition, transfer, weight shard and reduction.

One function, used by the simulator (to time it) and the executor (to run it); neither
re-derives any of it. A ``parameter`` or ``constant`` op (a tensor the model reads with
get_attr, e.g. GPT's position embedding) is a weight like any other: every partition that reads
it holds a replica of the region it reads, no transfer brings it, and its gradient is
all-reduced over those replicas (so data parallel stays data parallel). The records are in
``strategies.lowered``, each op's derivation in ``strategies.pieces``, the state kept between
calls in ``strategies.lowering_cache``; their public names are all importable from here.
``lower_reference`` (``strategies.lowering_reference``) derives the same lowering plainly,
with no cache: read it first.
"""

from __future__ import annotations

import itertools
import operator
from typing import Iterable

from strategies.drops import key_readers
from strategies.graph import OpGraph
from strategies.lowered import (WEIGHT_KINDS, BucketKey, DeviceBytes, Gate, GradientSync, Lowered, OpPieces,
                                Partition, ReductionGroup, Transfer, WeightRead, WeightShard, bucket_key,
                                split_buckets)
from strategies.lowering_cache import Last, changed_ops, same_objects, update
from strategies.lowering_copies import expand_totals
from strategies.lowering_reference import lower_reference
from strategies.precision import compute_graph
from strategies.pieces import check_microbatches, gates, partition_box_mb
from strategies.strategy import Strategy
from strategies.symmetry import Copies
from strategies.zero import gather_uses

__all__ = ["PATCHED", "is_patched_state", "WEIGHT_KINDS", "Partition", "Transfer", "WeightRead", "WeightShard",
           "BucketKey", "bucket_key",
           "ReductionGroup", "OpPieces", "Lowered", "DeviceBytes", "GradientSync", "Gate", "lower", "lower_reference",
           "partition_box_mb", "gates", "bucket_sums", "loss_on_every_device", "SMALL_SUM"]


SMALL_SUM = 1 << 16
"""Elements (one member's count times the members) up to which a group's sum is an all-gather
of every member's tensor added in member order (the same bits on every member) rather than an
all-reduce: the executor's ``Group.sum``, the simulator's ``group_sum_time``."""


def loss_on_every_device(lowered: "Lowered") -> bool:
    """Every device holds a partition of the loss op (the graph's first output) in every
    micro-batch: each then learns the step's loss from its group's sum, and no all-reduce of
    the loss value is needed (the executor runs one otherwise, the simulator charges it)."""
    everyone = set(range(lowered.strategy.num_devices))
    images = {} if lowered.copies is None else lowered.copies.stands_for  # copy 0's: every copy's too
    return all({x for p in parts for x in images.get(p.device, (p.device,))} == everyone
               for parts in lowered.partitions[lowered.graph.outputs[0]])


def bucket_sums(lowered: "Lowered", groups: "Iterable[ReductionGroup] | None" = None
                ) -> dict[ReductionGroup, BucketKey]:
    """The ``Gate.STEP`` sums that travel in a gradient bucket, with the bucket. ``groups``:
    the plan's STEP sums in graph order, when the caller has them (else every reduction is looked at).

    A sum gated STEP (a loss's Σ w_i·ℓ_i and Σ w_i) is read only at the end of the step, where
    the gradient sync all-reduces one flat tensor per gradient bucket (``bucket_key``: device
    set, dtype). When its members are exactly a bucket's device set and its dtype the
    bucket's, the executor appends each member's contribution to that bucket (a sum is a sum:
    one all-reduce for both) and divides the summed gradients by C afterwards (1/C·Σ g = Σ g/C);
    the simulator adds its bytes to that bucket instead of timing a collective of its own."""
    wanted: dict[BucketKey, list[ReductionGroup]] = {}
    for g in lowered.reductions if groups is None else groups:
        if g.gates is Gate.STEP:
            wanted.setdefault(BucketKey(tuple(sorted(g.devices)), lowered.graph[g.op].output.dtype), []).append(g)
    out = {}
    for s in lowered.weight_shards:  # until every wanted bucket is found (data parallel: the first)
        if not wanted:
            break
        key = bucket_key(s)
        if key is not None:
            for g in wanted.pop(key, ()):
                out[g] = key
    return out


_shards = operator.attrgetter("shards")



PATCHED = ("last", "buckets")
"""The kinds of state ``lower`` keeps in its cache and patches in place from call to call (a copy
set's last lowering and its bucket split), keyed ``(kind, microbatches, devices, copies)``."""


def _state(kind: str, m: int, n: int, copies) -> tuple:
    return (kind, m, n, copies)


def is_patched_state(key) -> bool:
    """Whether the cache ``key`` holds state ``lower`` patches in place (``PATCHED``), which a
    trial cache over a search's (``soapsearch.search.scratch``) builds apart instead of reading."""
    return type(key) is tuple and len(key) == 4 and key[0] in PATCHED

def lower(graph: OpGraph, strategy: Strategy, cache: dict | None = None, copies: Copies | None = None) -> Lowered:
    """Everything a plan does, derived once (docs/design.md, "The lowering"). ``cache`` (any dict kept
    across calls for one graph) memoizes each op's pieces by the configs they depend on, and
    each weight's shards by the pieces of the ops reading it; an op's config is validated when
    its pieces are first derived. The cache also keeps the previous call's lowering
    (``strategies.lowering_cache.Last``): only the ops whose config is not the very object of
    that call's plan (a search's proposal shares every unchanged config) and their consumers
    are looked at again, and the per-device totals (``DeviceBytes``, ``GradientSync``) are
    patched by what changed. ``copies`` (``strategies.symmetry.find_copies`` of this plan): the
    lowering of copy 0 only (``strategies.lowering_copies``; ``Lowered.copies``), kept in the
    cache apart from every other copy set's; ``CrossCopy`` where the plan's pieces cross
    copies. Any schedule and ZeRO level folds: the memory walks (``simulator.memory_walks``, the
    interleaved one once per pipeline rank) read copy 0's rows expanded to every device, and a
    level-2/3 use of a holder outside copy 0 is its copy-0 image's (``strategies.zero``)."""
    cache = {} if cache is None else cache  # none given: one used for this call only
    if strategy.precision != "model":  # its own graph (strategies.precision), its own cache
        graph = compute_graph(graph, strategy.compute_dtype)
        cache = cache.setdefault(("precision", strategy.precision), {})
    m, n = strategy.microbatches, strategy.num_devices
    last = cache.get(_state("last", m, n, copies))
    changed = changed_ops(last, strategy.configs)
    if changed is None:  # another list of ops than the last call's (a search's plans all name the same)
        strategy.validate(graph, configs=False)
        check_microbatches(graph, m)
        last = cache[_state("last", m, n, copies)] = Last(graph, n, copies)
        affected = list(graph)
    else:
        touched = set(changed).union(*map(graph.users, changed))
        # a producer's pieces read its consumers' recompute flags (drops.recompute_key)
        touched.update(p for c in changed for p in key_readers(graph, c))
        affected = [graph[name] for name in sorted(touched, key=last.position.__getitem__)]
    try:
        update(graph, strategy, cache, last, affected)
    except BaseException:  # a config found invalid half way: the next call starts over
        cache.pop(_state("last", m, n, copies), None)
        raise
    last.configs = strategy.configs
    shards = tuple(itertools.chain.from_iterable(map(_shards, last.held.values())))
    cap, split = (strategy.bucket_cap_bytes, strategy.reduce_dtype), cache.get(_state("buckets", m, n, copies))  # the last call's, where its shards are these
    if split is None or split[0] != cap or not same_objects(split[1], shards):
        split = cache[_state("buckets", m, n, copies)] = (cap, shards, split_buckets(shards, cap[0], strategy))
    buckets, of = split[2]
    sync = GradientSync(buckets, tuple(last.tensors.tolist()), of)
    totals = [tuple(t) for t in last.totals[:3]] + [tuple(t.tolist()) for t in last.totals[3:]]
    if copies is not None:
        totals[:3] = expand_totals(totals[:3], copies)
    lowered = Lowered(graph, strategy, dict(last.partitions), shards, dict(last.by_op), DeviceBytes(*totals), sync,
                      copies, dict(last.twins))
    gather_uses(lowered)  # level 3 (FSDP): PlanError unless every use pairs up
    return lowered
