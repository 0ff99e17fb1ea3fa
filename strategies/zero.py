"""Sharded state (ZeRO, Rajbhandari et al. 2020; FSDP2's ``fully_shard`` vocabulary): the one
chunking rule of a sharded gradient bucket, which the simulator prices and the executor runs.

A bucket of level 1 or 2 (``BucketKey.zero``) is the flat tensor of its shards' elements, each
shard's region flattened in row-major order, shards in ``Lowered.weight_shards`` order (the
order every member packs them). With n members (``BucketKey.devices``, sorted) the flat tensor
is padded with zeros to n·c elements, c = ⌈numel / n⌉, and member i owns chunk i,
[i·c, (i + 1)·c): what ``reduce_scatter_tensor`` leaves group rank i, and what it gives back
to ``all_gather_into_tensor`` (a ``Shard(0)`` of the flat tensor). A member holds the optimizer
state of its chunk only and updates its chunk (level 1: optimizer state sharded); at level 2 it
also keeps only its chunk of the summed gradient after the step.

Level 3 (FSDP2's ``fully_shard``): each trainable shard on its own is cut so (its region
flattened, padded, ``Shard(0)`` chunk i on member i), and the member keeps only its chunk of
the weight. Every use gathers it (``gather_uses``): before the forward of each reader op's
partition in each micro-batch an all-gather, freed after it (reshard after forward), again
before its backward, then the gradient reduce-scattered into the chunk's and freed.
"""

from __future__ import annotations

from typing import NamedTuple

from strategies.errors import PlanError
from strategies.graph import DTYPE_BYTES
from strategies.lowered import WEIGHT_KINDS, BucketKey, Lowered, WeightShard, bucket_key
from strategies.region import box_numel

__all__ = ["ZeroBucket", "chunk_numel", "chunk_span", "zero_buckets", "gathered_shards", "GatherUse", "gather_uses",
           "ShardedState", "sharded_state"]


def chunk_numel(numel: int, n: int) -> int:
    """Elements of each member's chunk of a flat tensor of ``numel`` elements over ``n``
    members: ⌈numel / n⌉ (the flat tensor is padded to n times that)."""
    return -(-numel // n)


def chunk_span(numel: int, n: int, i: int) -> tuple[int, int]:
    """The elements [lo, hi) of the unpadded flat tensor that member ``i`` owns (empty where
    the chunk is all padding)."""
    c = chunk_numel(numel, n)
    return min(i * c, numel), min((i + 1) * c, numel)


class ZeroBucket(NamedTuple):
    """One sharded gradient bucket: its key, its shards in flat order and their sizes."""

    key: BucketKey
    shards: tuple[WeightShard, ...]
    numel: int

    @property
    def chunk(self) -> int:
        """Elements of each member's chunk (``chunk_numel``)."""
        return chunk_numel(self.numel, len(self.key.devices))

    @property
    def chunk_bytes(self) -> int:
        return self.chunk * DTYPE_BYTES[self.key.dtype]


def zero_buckets(lowered: Lowered) -> dict[BucketKey, ZeroBucket]:
    """The plan's buckets of level ≥ 1, in sorted key order, each with its shards in the flat
    tensor's order."""
    if not any(k.zero in (1, 2) for k in lowered.gradient_sync.buckets):
        return {}
    shards: dict[BucketKey, list[WeightShard]] = {}
    for s in lowered.weight_shards:
        key = bucket_key(s)
        if key is not None and key.zero in (1, 2):
            shards.setdefault(key, []).append(s)
    return {k: ZeroBucket(k, tuple(shards[k]), lowered.gradient_sync.buckets[k] // DTYPE_BYTES[k.dtype])
            for k in sorted(shards)}


def gathered_shards(lowered: Lowered) -> tuple[WeightShard, ...]:
    """The level-3 shards (trainable, replicated), in ``Lowered.weight_shards`` order."""
    if not any(k.zero == 3 for k in lowered.gradient_sync.buckets):
        return ()
    return tuple(s for s in lowered.weight_shards if s.zero == 3)


class GatherUse(NamedTuple):
    """Op ``op`` reads level-3 shard ``shard``: in every micro-batch, partition
    ``partitions[i]`` on member ``shard.devices[i]``, each once. Every member all-gathers the
    shard before that partition's forward and before its backward, and reduce-scatters its
    gradient after the backward."""

    shard: WeightShard
    op: str
    partitions: tuple[int, ...]


def gather_uses(lowered: Lowered) -> tuple[GatherUse, ...]:
    """Every use of a level-3 shard, by reader op in graph order, then shard order (the order
    each member calls them within a step). PlanError where a member of a shard reads it through
    another number of partitions of an op than one (the members' calls would not pair up)."""
    shards = gathered_shards(lowered)
    if not shards:
        return ()
    graph, out = lowered.graph, []
    for node in graph:
        names = {w.name: w.role for w in node.weights}
        slots = {graph[src].weights[0].name: i for i, src in enumerate(node.inputs)
                 if graph[src].kind in WEIGHT_KINDS and graph[src].weights}
        for s in shards:
            if node.name not in s.ops or (s.name not in names and s.name not in slots):
                continue
            on: dict[int, list[int]] = {}
            for p in lowered.partitions[node.name][0]:
                box = dict(p.weight_regions).get(names[s.name]) if s.name in names else p.input_regions[slots[s.name]]
                if box == s.region:
                    on.setdefault(p.device, []).append(p.index)
            if not on:
                continue
            if sorted(on) != list(s.devices) or any(len(ks) != 1 for ks in on.values()):
                counts = {d: len(on.get(d, ())) for d in s.devices}
                raise PlanError(node.name, "zero", 3, f"weight {s.name!r} region {list(map(list, s.region))} is read "
                                f"by {counts} partitions of the op per replica device: level 3 gathers it once per use "
                                "on every replica, so each must read it through one partition")
            out.append(GatherUse(s, node.name, tuple(on[d][0] for d in s.devices)))
    return tuple(out)


class ShardedState(NamedTuple):
    """Per device (one entry each): what its optimizer updates and what its sharded buckets
    leave it holding."""

    updated: tuple[int, ...]
    """Bytes of weights the device's optimizer updates, each with ``OPTIMIZER_STATE`` bytes of
    state: its trainable shards in no sharded bucket, plus its chunk of each sharded one."""
    tensors: tuple[int, ...]
    """Tensors its optimizer steps: each weight none of whose shards is sharded, plus one flat
    chunk per sharded bucket."""
    chunks: tuple[int, ...]
    """Bytes of its chunks of the sharded buckets (the chunk's working copy the optimizer
    updates before the all-gather; float32 master in mixed precision)."""
    sharded: tuple[int, ...]
    """Bytes of its trainable shards that are in a sharded bucket (their full size)."""
    held3: tuple[int, ...] = ()
    """Level 3: bytes of its chunks of the level-3 shards (all it keeps of them)."""
    sharded3: tuple[int, ...] = ()
    """Level 3: the full bytes of the level-3 shards it holds a chunk of."""
    gathered: tuple[int, ...] = ()
    """Level 3: the largest gathered set of one use, Σ the full bytes of the level-3 shards
    one of its partitions reads (``gather_uses``)."""


def sharded_state(lowered: Lowered) -> ShardedState:
    """``ShardedState`` of ``lowered`` (with no sharded bucket: the trainable bytes and the
    per-device tensor counts of ``GradientSync``)."""
    n = lowered.strategy.num_devices
    trainable, tensors = lowered.device_bytes.trainable, lowered.gradient_sync.tensors
    buckets = zero_buckets(lowered)
    uses = gather_uses(lowered)
    none = (0,) * n
    if not buckets and not uses:
        return ShardedState(trainable, tensors, none, none, none, none, none)
    chunks, sharded, count = [0] * n, [0] * n, list(tensors)
    held3, sharded3 = [0] * n, [0] * n
    leaves: set[tuple[int, str]] = set()
    for b in buckets.values():
        for d in b.key.devices:
            chunks[d] += b.chunk_bytes
            sharded[d] += sum(s.nbytes for s in b.shards)
            count[d] += 1
            leaves.update((d, s.name) for s in b.shards)
    for s in gathered_shards(lowered):
        c = chunk_numel(box_numel(s.region), len(s.devices)) * DTYPE_BYTES[s.dtype]
        for d in s.devices:
            held3[d] += c
            sharded3[d] += s.nbytes
            count[d] += 1
            leaves.add((d, s.name))
    for d, _ in leaves:
        count[d] -= 1
    per_use: dict[tuple[int, str, int], int] = {}
    for u in uses:
        for d, k in zip(u.shard.devices, u.partitions):
            per_use[(d, u.op, k)] = per_use.get((d, u.op, k), 0) + u.shard.nbytes
    gathered = [0] * n
    for (d, _, _), b in per_use.items():
        gathered[d] = max(gathered[d], b)
    updated = tuple(t - s + c - s3 + h for t, s, c, s3, h in zip(trainable, sharded, chunks, sharded3, held3))
    return ShardedState(updated, tuple(count), tuple(chunks), tuple(sharded), tuple(held3), tuple(sharded3),
                        tuple(gathered))
