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
"""

from __future__ import annotations

from typing import NamedTuple

from strategies.graph import DTYPE_BYTES
from strategies.lowered import BucketKey, Lowered, WeightShard, bucket_key

__all__ = ["ZERO_RUN", "ZeroBucket", "chunk_numel", "chunk_span", "zero_buckets", "ShardedState", "sharded_state"]

ZERO_RUN = (0, 1, 2)
"""The levels the lowering, the simulator and the executor implement; level 3 (weights
sharded, gathered per use) is refused with a PlanError naming the op."""


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
    if not any(k.zero for k in lowered.gradient_sync.buckets):
        return {}
    shards: dict[BucketKey, list[WeightShard]] = {}
    for s in lowered.weight_shards:
        key = bucket_key(s)
        if key is not None and key.zero:
            shards.setdefault(key, []).append(s)
    return {k: ZeroBucket(k, tuple(shards[k]), lowered.gradient_sync.buckets[k] // DTYPE_BYTES[k.dtype])
            for k in sorted(shards)}


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


def sharded_state(lowered: Lowered) -> ShardedState:
    """``ShardedState`` of ``lowered`` (with no sharded bucket: the trainable bytes and the
    per-device tensor counts of ``GradientSync``)."""
    n = lowered.strategy.num_devices
    trainable, tensors = lowered.device_bytes.trainable, lowered.gradient_sync.tensors
    buckets = zero_buckets(lowered)
    if not buckets:
        return ShardedState(trainable, tensors, (0,) * n, (0,) * n)
    chunks, sharded, count = [0] * n, [0] * n, list(tensors)
    leaves: set[tuple[int, str]] = set()
    for b in buckets.values():
        for d in b.key.devices:
            chunks[d] += b.chunk_bytes
            sharded[d] += sum(s.nbytes for s in b.shards)
            count[d] += 1
            leaves.update((d, s.name) for s in b.shards)
    for d, _ in leaves:
        count[d] -= 1
    return ShardedState(tuple(t - s + c for t, s, c in zip(trainable, sharded, chunks)), tuple(count),
                        tuple(chunks), tuple(sharded))
