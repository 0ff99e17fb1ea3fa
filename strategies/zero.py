"""Sharded state (ZeRO, Rajbhandari et al. 2020; FSDP2's ``fully_shard`` vocabulary): the one
chunking rule of sharded weight state, which the simulator prices and the executor runs.

Level 1 (optimizer state sharded): a gradient bucket (``BucketKey.zero`` 1; a group's shards
are cut into buckets at the plan's cap, ``strategies.lowered.split_buckets``) is the flat tensor
of its shards' elements, each shard's region flattened in row-major order, shards in
``Lowered.weight_shards`` order (the order every member packs them). With n members
(``BucketKey.devices``, sorted) the flat tensor is padded with zeros to n·c elements,
c = ⌈numel / n⌉, and member i owns chunk i, [i·c, (i + 1)·c): what ``reduce_scatter_tensor``
leaves group rank i, and what it gives back to ``all_gather_into_tensor`` (a ``Shard(0)`` of the
flat tensor). At the step end the bucket is reduce-scattered, each member updates its chunk (it
holds the chunk's optimizer state only), and the chunks are all-gathered into the weights.

Levels 2 and 3 cut each trainable shard on its own the same way (its region flattened, padded,
chunk i on member i), and work per use (``gather_uses``: each reader op's partition on each
member, in each micro-batch): after the partition's backward its gradient is reduce-scattered
into the chunk's and the full gradient freed. Level 2 (FSDP's ``SHARD_GRAD_OP``) keeps the
weight whole and all-gathers the updated chunks after the step; level 3 (FSDP2's
``fully_shard``) keeps only the chunk of the weight and all-gathers it before the partition's
forward, frees it after (reshard after forward) and gathers it again before its backward.

The calls of one use are grouped as FSDP2 groups a ``fully_shard`` unit's parameters
(``FSDPParamGroup``): the level-2 or level-3 shards a reader partition reads on the same device
set (at one level and dtype) are one ``GatherGroup``, one all-gather per phase and one
reduce-scatter for all of them. Each shard is still chunked on its own, so member i's chunk of
the group is the concatenation of its chunks of the shards, in ``Lowered.weight_shards`` order:
the all-gather gives n rows of Σ c_s elements, row i member i's, each row's span s being shard
s's chunk i; the reduce-scatter's input is laid out the same way.
"""

from __future__ import annotations

from operator import is_
from typing import NamedTuple

from strategies.errors import PlanError
from strategies.graph import DTYPE_BYTES
from strategies.lowered import WEIGHT_KINDS, BucketKey, Lowered, WeightShard
from strategies.memo import per_lowered
from strategies.region import box_numel

__all__ = ["ZeroBucket", "chunk_numel", "chunk_span", "zero_buckets", "per_use_shards", "shard_chunk_bytes", "GatherUse",
           "gather_uses", "GatherGroup", "gather_groups", "ShardedState", "sharded_state"]


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


@per_lowered
def zero_buckets(lowered: Lowered) -> dict[BucketKey, ZeroBucket]:
    """The plan's buckets of level 1, in sorted key order, each with its shards in the flat
    tensor's order."""
    if not any(k.zero == 1 for k in lowered.gradient_sync.buckets):
        return {}
    shards: dict[BucketKey, list[WeightShard]] = {}
    for s, key in zip(lowered.weight_shards, lowered.gradient_sync.shard_buckets):
        if key is not None and key.zero == 1:
            shards.setdefault(key, []).append(s)
    return {k: ZeroBucket(k, tuple(shards[k]), lowered.gradient_sync.buckets[k] // DTYPE_BYTES[k.dtype])
            for k in sorted(shards)}


@per_lowered
def per_use_shards(lowered: Lowered) -> tuple[WeightShard, ...]:
    """The level-2 and level-3 shards (trainable, replicated), in ``Lowered.weight_shards``
    order: each chunked on its own and reduce-scattered per use."""
    if not any(k.zero >= 2 for k in lowered.gradient_sync.buckets):
        return ()
    return tuple(s for s in lowered.weight_shards if s.zero >= 2)


def shard_chunk_bytes(s: WeightShard) -> int:
    """Bytes of each member's chunk of a level-2 or level-3 shard."""
    return chunk_numel(box_numel(s.region), len(s.devices)) * DTYPE_BYTES[s.dtype]


class GatherUse(NamedTuple):
    """Op ``op`` reads level-2 or level-3 shard ``shard``: in every micro-batch, partition
    ``partitions[i]`` on member ``shard.devices[i]``, each once. Every member reduce-scatters
    its gradient after that partition's backward; at level 3 it also all-gathers the shard
    before the partition's forward and before its backward."""

    shard: WeightShard
    op: str
    partitions: tuple[int, ...]


@per_lowered
def gather_uses(lowered: Lowered) -> tuple[GatherUse, ...]:
    """Every use of a level-2 or level-3 shard, by reader op in graph order, then shard order
    (the order each member calls them within a step). PlanError where a member of a shard reads
    it through another number of partitions of an op than one (the calls would not pair up)."""
    shards = per_use_shards(lowered)
    if not shards:
        return ()
    graph, out = lowered.graph, []
    readers: dict[str, list[WeightShard]] = {}  # op -> the shards it reads, in shard order
    for s in shards:
        for op in dict.fromkeys(s.ops):
            readers.setdefault(op, []).append(s)
    copies = lowered.copies
    if _KEPT[0] is not graph or _KEPT[1] != copies:  # a copy set found again is another, equal object
        _KEPT[:] = [graph, copies, {}]
    kept = _KEPT[2]
    for node in graph:
        mine = readers.get(node.name)
        if not mine:
            continue
        parts = lowered.partitions[node.name]
        was = kept.get(node.name)
        if was is None or was[0] is not parts or len(was[1]) != len(mine) or not all(map(is_, was[1], mine)):
            was = kept[node.name] = (parts, mine, _op_uses(graph, node, parts[0], mine, copies))
        out += was[2]
    return tuple(out)


_KEPT: list = [None, None, {}]
"""The graph and copy set of the last ``gather_uses`` and, per reader op, (its partitions, the
shards it reads, its uses): a lowering shares an unchanged op's partitions and shards with the last one
(``strategies.lowering_cache``), so only the changed ops' uses are found again."""


def _op_uses(graph, node, parts, mine: list[WeightShard], copies=None) -> list[GatherUse]:
    """The uses of ``mine`` (the level-2/3 shards ``node`` reads, in shard order) by ``node``'s
    micro-batch-0 partitions ``parts``. ``copies`` (a folded lowering's, ``Lowered.copies``):
    ``parts`` are the kept devices'; a holder in copy r reads the shard through the φ_r-image of
    its copy-0 image's partition (the same region: it does not depend on the sample
    coordinate), which stands here as that kept partition's index (``Copies.representative``).
    Under a member fold a shard that member m ≥ 2 alone reads has no use here: no kept
    partition reads its region, and member 1's uses stand for member m's
    (``strategies.lowering_members``)."""
    rep = {} if copies is None else copies.representative
    out = []
    names = {w.name: w.role for w in node.weights}
    slots = {graph[src].weights[0].name: i for i, src in enumerate(node.inputs)
             if graph[src].kind in WEIGHT_KINDS and graph[src].weights}
    for s in mine:
        if s.name not in names and s.name not in slots:
            continue
        on: dict[int, list[int]] = {}
        for p in parts:
            box = dict(p.weight_regions).get(names[s.name]) if s.name in names else p.input_regions[slots[s.name]]
            if box == s.region:
                on.setdefault(p.device, []).append(p.index)
        if not on:
            continue
        if sorted(on) != sorted({rep.get(d, d) for d in s.devices}) or any(len(ks) != 1 for ks in on.values()):
            counts = {d: len(on.get(rep.get(d, d), ())) for d in s.devices}
            raise PlanError(node.name, "zero", s.zero, f"weight {s.name!r} region {list(map(list, s.region))} is "
                            f"read by {counts} partitions of the op per replica device: level {s.zero} "
                            "reduce-scatters its gradient once per use on every replica, so each must read it "
                            "through one partition")
        out.append(GatherUse(s, node.name, tuple(on[rep.get(d, d)][0] for d in s.devices)))
    return out


class GatherGroup(NamedTuple):
    """The level-2 or level-3 shards op ``op`` reads through partition ``partitions[i]`` on member
    ``devices[i]``, all at one level and dtype: one all-gather per phase (level 3) and one
    reduce-scatter per use and micro-batch for all of them. Member i's chunk of the group is
    its chunks of ``shards`` concatenated, in order (``chunks`` elements each)."""

    op: str
    partitions: tuple[int, ...]
    shards: tuple[WeightShard, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return self.shards[0].devices

    @property
    def zero(self) -> int:
        return self.shards[0].zero

    @property
    def chunks(self) -> tuple[int, ...]:
        """Elements of each member's chunk of each shard (``chunk_numel``)."""
        return tuple(chunk_numel(box_numel(s.region), len(s.devices)) for s in self.shards)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of each member's chunk of the group: what it gives the all-gather."""
        return sum(self.chunks) * DTYPE_BYTES[self.shards[0].dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the group's shards, whole (what one gather leaves a member)."""
        return sum(s.nbytes for s in self.shards)


@per_lowered
def gather_groups(lowered: Lowered) -> tuple[GatherGroup, ...]:
    """``gather_uses`` grouped: per reader op (graph order) and each (partitions, device set,
    level, dtype) it reads shards through, one group of those shards (``Lowered.weight_shards``
    order), groups in the order of their first shard: the order each member calls them."""
    groups: dict[tuple, list[WeightShard]] = {}
    for u in gather_uses(lowered):
        s = u.shard
        groups.setdefault((u.op, u.partitions, s.devices, s.zero, s.dtype), []).append(s)
    return tuple(GatherGroup(op, parts, tuple(ss)) for (op, parts, *_), ss in groups.items())


class ShardedState(NamedTuple):
    """Per device (one entry each): what its optimizer updates and what its sharded state
    leaves it holding."""

    updated: tuple[int, ...]
    """Bytes of weights the device's optimizer updates, each with ``OPTIMIZER_STATE`` bytes of
    state: its trainable shards at level 0, its chunks of the others."""
    tensors: tuple[int, ...]
    """Tensors its optimizer steps: each weight at level 0, one flat chunk per level-1 bucket
    and per level-2 or level-3 shard."""
    copies: tuple[int, ...]
    """Bytes of the chunks' working copies (levels 1 and 2: the weight stays whole beside it;
    float32 master in mixed precision): what the optimizer updates before the all-gather."""
    weights: tuple[int, ...]
    """Bytes of the trainable weights it keeps: whole, but a level-3 shard as its chunk."""
    gradients: tuple[int, ...]
    """Bytes of the gradients it keeps: whole at levels 0 and 1 (accumulated in the backward,
    reduce-scattered at the step end), a level-2 or level-3 shard's as its chunk."""


@per_lowered
def sharded_state(lowered: Lowered) -> ShardedState:
    """``ShardedState`` of ``lowered``: the sharded shards' terms summed per device set (a
    data-parallel plan's few), then added to each member."""
    n = lowered.strategy.num_devices
    trainable, tensors = lowered.device_bytes.trainable, lowered.gradient_sync.tensors
    buckets = zero_buckets(lowered)
    groups = gather_groups(lowered)
    if not buckets and not groups:
        return ShardedState(trainable, tensors, (0,) * n, trainable, trainable)
    # per device set: [updated, copies, weights, gradients, tensors] added to each member, the weights' names
    terms: dict[tuple[int, ...], tuple[list[int], set[str]]] = {}
    for b in buckets.values():
        add, names = terms.setdefault(b.key.devices, ([0] * 5, set()))
        add[0] += b.chunk_bytes - sum(s.nbytes for s in b.shards)
        add[1] += b.chunk_bytes
        add[4] += 1
        names.update(s.name for s in b.shards)
    for s in per_use_shards(lowered):
        c = shard_chunk_bytes(s)
        add, names = terms.setdefault(s.devices, ([0] * 5, set()))
        add[0] += c - s.nbytes
        add[3] += c - s.nbytes
        add[2 if s.zero == 3 else 1] += c - s.nbytes if s.zero == 3 else c
        add[4] += 1
        names.add(s.name)
    updated, weights, gradients, copies, count = list(trainable), list(trainable), list(trainable), [0] * n, list(tensors)
    leaves: dict[int, set[str]] = {}  # device -> the weights its sharded tensors replace (once each)
    for devices, (add, names) in terms.items():
        for d in devices:
            updated[d] += add[0]
            copies[d] += add[1]
            weights[d] += add[2]
            gradients[d] += add[3]
            count[d] += add[4]
            leaves.setdefault(d, set()).update(names)
    for d, names in leaves.items():
        count[d] -= len(names)
    return ShardedState(*map(tuple, (updated, count, copies, weights, gradients)))
