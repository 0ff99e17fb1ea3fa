"""The lowering: (OpGraph, Strategy) -> every partition, transfer, weight shard and reduction.

One function, used by the simulator (to time it) and the executor (to run it); neither
re-derives any of it. A ``parameter`` or ``constant`` op (a tensor the model reads with
get_attr, e.g. GPT's position embedding) is a weight like any other: every partition that reads
it holds a replica of the region it reads, no transfer brings it, and its gradient is
all-reduced over those replicas (so data parallel stays data parallel). Coordinates are global: a partition of micro-batch j covers rows
[j·B/m + c·B/(m·d), ...) of the sample dim (B batch, m micro-batches, d the sample degree).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple, Sequence

from strategies.graph import DTYPE_BYTES, OpGraph, OpNode
from strategies.region import Box, box_numel, intersect, partition_index
from strategies.rules import get_rule
from strategies.rules.base import Reduction
from strategies.strategy import Strategy

WEIGHT_KINDS = ("parameter", "constant")
_new = tuple.__new__

__all__ = ["WEIGHT_KINDS", "Partition", "Transfer", "WeightShard", "ReductionGroup", "OpPieces", "Lowered",
           "GradientSync", "lower", "partition_box_mb", "gates", "bucket_sums", "loss_on_every_device", "SMALL_SUM", "FORWARD",
           "BACKWARD", "STEP"]


class Partition(NamedTuple):
    """Partition ``index`` of ``op`` for ``microbatch``: on ``device`` it computes ``box``,
    reading ``input_regions`` (one per input; None: nothing) and ``weight_regions``."""

    op: str
    index: int
    microbatch: int
    device: int
    box: Box
    input_regions: tuple[Box | None, ...]
    weight_regions: tuple[tuple[str, Box], ...]


class Transfer(NamedTuple):
    """Bytes of ``src_op``'s partition ``src_index`` that ``dst_op``'s partition ``dst_index``
    reads as its input ``slot``. Backward moves the same region's gradient from dst to src.
    ``src_device == dst_device`` marks a local read (a dependency, no bytes on a link)."""

    src_op: str
    src_index: int
    dst_op: str
    dst_index: int
    slot: int
    microbatch: int
    src_device: int
    dst_device: int
    region: Box
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src_device == self.dst_device


@dataclass(frozen=True)
class WeightShard:
    """A region of one weight held on ``devices``; with several devices its gradient is
    all-reduced over exactly them. ``ops`` are the ops reading it (a tied weight: several)."""

    name: str
    region: Box
    devices: tuple[int, ...]
    nbytes: int
    ops: tuple[str, ...]
    trainable: bool = True


@dataclass(frozen=True)
class ReductionGroup:
    """Partitions of ``op`` (micro-batch ``microbatch``) whose rule asks for a sum across them
    (batch statistics, a loss over a split batch), and the devices that hold them."""

    op: str
    name: str
    microbatch: int
    partitions: tuple[int, ...]
    devices: tuple[int, ...]
    nbytes: int
    """One member's contribution to the forward sum."""
    gates: str = "forward"
    """What waits on the sum (``gates``): FORWARD, BACKWARD or STEP."""
    grad_nbytes: int = 0
    """One member's contribution to the backward sum (0: the backward sums nothing)."""


class OpPieces(NamedTuple):
    """What one op contributes to a lowering; a function of its config, its producers' configs
    and the micro-batch count only, so a search can reuse it for every unchanged op."""

    partitions: tuple[tuple[Partition, ...], ...]
    transfers: tuple[Transfer, ...]
    reductions: tuple[ReductionGroup, ...]
    weight_reads: tuple[tuple[str, Box, int, str, int, bool], ...]
    """(weight name, region, device, reading op, itemsize, trainable) for microbatch 0."""
    weights_read: tuple[str, ...]
    """The weight names in ``weight_reads``, once each."""
    couples: frozenset[tuple[int, int]]
    """Device pairs (a, b) where a's data flows to b: remote transfers into the op, and each
    reduction's ring in both directions (``strategies.schedule.warmups`` reads them)."""
    activations: tuple[int, ...]
    """Bytes each device keeps for backward per micro-batch (one entry per device): each
    partition's output and each remote piece it receives (``simulator.memory``)."""
    receives: tuple[tuple[int, ...], tuple[int, ...]]
    """(forward, gradient) bytes each device receives per micro-batch (one entry per device):
    the remote pieces into the op on their consumer's device, and their gradients on the
    producer's device when both ops need one (the executor posts them a micro-batch ahead;
    ``simulator.memory``)."""


class DeviceBytes(NamedTuple):
    """Per-device totals over a plan's ops and weights (one entry per device each)."""

    kept: tuple[int, ...]
    """Σ ``OpPieces.activations``: bytes kept for backward per micro-batch."""
    received: tuple[int, ...]
    """Σ forward ``OpPieces.receives``: bytes received per micro-batch."""
    received_grad: tuple[int, ...]
    """Σ gradient ``OpPieces.receives``: gradient bytes received per micro-batch."""
    trainable: tuple[int, ...]
    """Bytes of the trainable weight shards held."""
    frozen: tuple[int, ...]
    """Bytes of the other weight shards held."""


class GradientSync(NamedTuple):
    """What the gradient sync of a plan's trainable weight shards amounts to."""

    buckets: dict[tuple[int, ...], int]
    """Device set of > 1 devices -> bytes of the trainable shards replicated on exactly it (one
    DDP-style bucket each, ``simulator.step``)."""
    tensors: tuple[int, ...]
    """Trainable weights each device holds a shard of (one entry per device)."""


@dataclass(frozen=True)
class Lowered:
    graph: OpGraph
    strategy: Strategy
    partitions: dict[str, tuple[tuple[Partition, ...], ...]]
    """op -> micro-batch -> its partitions in partition order."""
    weight_shards: tuple[WeightShard, ...]
    pieces: dict[str, OpPieces]
    """op -> what it contributes (the same object for an unchanged op when lowered with a cache:
    consumers of the lowering cache their own per-op work by its identity)."""
    device_bytes: DeviceBytes
    """Per-device byte totals of the plan (``simulator.memory`` reads them)."""
    gradient_sync: GradientSync
    """The buckets and per-device tensor counts of ``weight_shards``' sync (``simulator.step``)."""

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every op's transfers, in graph order (gathered when first read)."""
        return tuple(itertools.chain.from_iterable(map(operator.itemgetter(1), self.pieces.values())))  # .transfers

    @cached_property
    def reductions(self) -> tuple[ReductionGroup, ...]:
        """Every op's reduction groups, in graph order (gathered when first read)."""
        return tuple(itertools.chain.from_iterable(map(operator.itemgetter(2), self.pieces.values())))  # .reductions

    @property
    def bytes_moved(self) -> int:
        """Forward bytes crossing links (backward moves as many again)."""
        return sum(t.nbytes for t in self.transfers if not t.local)


def _grid(node: OpNode, degrees: Sequence[int], microbatch: int,
          microbatches: int) -> tuple[tuple[int, int], ...]:
    """Per dim (base, step): coordinate c of that dim covers [base + c·step, base + (c+1)·step)."""
    s = node.sample_dim
    out = []
    for i, (size, d) in enumerate(zip(node.shape, degrees)):
        if i == s and microbatches > 1:
            span = size // microbatches
            out.append((microbatch * span, span // d))
        else:
            out.append((0, size // d))
    return tuple(out)


def _boxes(grid: Sequence[tuple[int, int]], degrees: Sequence[int]) -> list[Box]:
    """Every partition's box in partition order (mixed radix, last dim fastest)."""
    ranges = [[(b + c * st, b + (c + 1) * st) for c in range(d)] for (b, st), d in zip(grid, degrees)]
    return [tuple(x) for x in itertools.product(*ranges)]


def partition_box_mb(node: OpNode, degrees: Sequence[int], k: int, microbatch: int,
                     microbatches: int) -> Box:
    """The global region partition ``k`` of ``node`` computes in ``microbatch``."""
    grid = _grid(node, degrees, microbatch, microbatches)
    return tuple((b + c * st, b + (c + 1) * st)
                 for (b, st), c in zip(grid, partition_index(k, degrees)))


def _overlaps(grid: Sequence[tuple[int, int]], degrees: Sequence[int],
              region: Box) -> list[tuple[int, Box, int]]:
    """(index, the part of ``region`` it holds, that part's elements) of each partition whose
    box overlaps ``region``, in partition order. Per dim the grid is regular: the overlapping
    coordinates are a range and each one's cut of the region an interval, so no box is
    intersected (coordinate c of a dim covers [base + c·step, base + (c+1)·step), ``_grid``)."""
    axes = []
    for (lo, hi), (base, step), d in zip(region, grid, degrees):
        first = (lo - base) // step
        last = (hi - 1 - base) // step
        if first < 0:
            first = 0
        if last > d - 1:
            last = d - 1
        if first > last:
            return []
        cells = []
        for c in range(first, last + 1):  # each overlaps: base + c·step < hi and base + (c+1)·step > lo
            a = base + c * step
            b = a + step
            a, b = (lo if lo > a else a), (hi if hi < b else b)
            cells.append((c, (a, b), b - a))
        axes.append(cells)
    out = []
    for combo in itertools.product(*axes):
        k, numel = 0, 1
        for (c, _, size), d in zip(combo, degrees):
            k = k * d + c
            numel *= size
        out.append((k, tuple([iv for _, iv, _ in combo]), numel))
    return out


FORWARD, BACKWARD, STEP = "forward", "backward", "step"


def gates(node: OpNode, red: Reduction, parts: Sequence[Partition], m: int, num_devices: int,
          output: bool = True) -> str:
    """What must wait for reduction ``red`` of ``node``'s partitions ``parts`` (one micro-batch);
    ``output``: ``node`` is the graph's output (a loss feeding another op must be whole first):

    - FORWARD: the partitions' outputs (batch statistics; a loss that is not the output);
      their backward sums again.
    - STEP: only the end of the step. A deferred sum (a loss: Σ w_i·ℓ_i and Σ w_i) whose divisor
      is known without data (``Loss.static_count``), or whose divisor C scales every gradient
      after the backward pass: one micro-batch (m = 1) with the loss on every device, so each
      device scales its own gradients by 1/C (gradients are linear in the seed).
    - BACKWARD: the loss partitions' backward, seeded 1/(m·C_j) once C_j is known.
    """
    if not red.deferred or not output:
        return FORWARD
    static = get_rule(node.kind).static_count(node) is not None  # deferred: a loss rule
    everywhere = {p.device for p in parts} == set(range(num_devices))
    return STEP if static or (m == 1 and everywhere) else BACKWARD


SMALL_SUM = 1 << 16
"""Elements (one member's count times the members) up to which a group's sum is an all-gather
of every member's tensor added in member order (the same bits on every member) rather than an
all-reduce: the executor's ``Group.sum``, the simulator's ``group_sum_time``."""


def loss_on_every_device(lowered: "Lowered") -> bool:
    """Every device holds a partition of the loss op (the graph's first output) in every
    micro-batch: each then learns the step's loss from its group's sum, and no all-reduce of
    the loss value is needed (the executor runs one otherwise, the simulator charges it)."""
    everyone = set(range(lowered.strategy.num_devices))
    return all({p.device for p in parts} == everyone for parts in lowered.partitions[lowered.graph.outputs[0]])


def bucket_sums(lowered: "Lowered") -> dict[ReductionGroup, tuple[int, ...]]:
    """The STEP sums that travel in a gradient bucket, with the bucket's device set.

    A sum gated STEP (a loss's Σ w_i·ℓ_i and Σ w_i) is read only at the end of the step, where
    the gradient sync all-reduces one flat bucket per (device set, dtype) of replicated
    trainable shards. When its members are exactly such a device set and its dtype the
    bucket's, the executor appends each member's contribution to that bucket (a sum is a sum:
    one all-reduce for both) and divides the summed gradients by C afterwards (1/C·Σ g = Σ g/C);
    the simulator adds its bytes to that bucket instead of timing a collective of its own."""
    wanted = {}
    for g in lowered.reductions:
        if g.gates == STEP:
            wanted.setdefault((tuple(sorted(g.devices)), lowered.graph[g.op].output.dtype), []).append(g)
    out = {}
    dtypes = lowered.graph.weight_dtypes
    for s in lowered.weight_shards:  # until every wanted bucket is found (data parallel: the first)
        if not wanted:
            break
        if s.trainable and len(s.devices) > 1:
            for g in wanted.pop((s.devices, dtypes[s.name]), ()):
                out[g] = s.devices
    return out


def _reduction_bytes(node: OpNode, name: str, box: Box, when: str) -> tuple[int, int]:
    """(forward, backward) bytes of one partition's contribution to a reduction, as the
    executor sends them. Batch statistics over C channels, in float32 (float64 for a float64
    tensor, as torch's batchnorm): forward (2C + 1) elements — mean, variance and the count —
    backward 2C — Σdy and Σdy·x̂ (SyncBatchNorm's). A loss, in its dtype: [s_p, c_p] (Σw·ℓ, Σw)
    when its divisor needs the data, s_p alone when it is static (``Loss.static_count``; a loss
    summed in the forward, ``Loss.forward``, sends s_p alone only for reduction="sum");
    nothing backward (the loss's backward has no collective), unless the sum gates the forward
    (a loss that is not the output: its backward sums the same elements)."""
    if name == "batch_stats" and len(box) > 1:
        size = 8 if node.output.dtype == "float64" else 4
        channels = box[1][1] - box[1][0]
        return (2 * channels + 1) * size, 2 * channels * size
    one = node.attrs["reduction"] == "sum" if when == FORWARD else get_rule(node.kind).static_count(node) is not None
    sums = (1 if one else 2) * DTYPE_BYTES[node.output.dtype]
    return sums, sums if when == FORWARD else 0


def lower(graph: OpGraph, strategy: Strategy, cache: dict | None = None) -> Lowered:
    """Everything a plan does, derived once (DESIGN.md "The lowering"). ``cache`` (any dict kept
    across calls for one graph) memoizes each op's pieces by the configs they depend on, and
    each weight's shards by the pieces of the ops reading it; an op's config is validated when
    its pieces are first derived. The cache also keeps the previous call's lowering (``_Last``):
    only the ops whose config is not the very object of that call's plan (a search's proposal
    shares every unchanged config) and their consumers are looked at again, and the
    per-device totals (``DeviceBytes``, ``GradientSync``) are patched by what changed."""
    cache = {} if cache is None else cache  # none given: one used for this call only
    m, n = strategy.microbatches, strategy.num_devices
    last = cache.get(("last", m, n))
    changed = _changed(last, strategy.configs)
    if changed is None:  # another list of ops than the last call's (a search's plans all name the same)
        strategy.validate(graph, configs=False)
        last = cache[("last", m, n)] = _Last(graph, n)
        affected = list(graph)
    else:
        touched = set(changed).union(*map(graph.users, changed))
        affected = [graph[name] for name in sorted(touched, key=last.position.__getitem__)]
    try:
        _update(graph, strategy, cache, last, affected)
    except BaseException:  # a config found invalid half way: the next call starts over
        cache.pop(("last", m, n), None)
        raise
    last.configs = strategy.configs
    shards = tuple(itertools.chain.from_iterable(map(operator.itemgetter(1), last.held.values())))  # _Held.shards
    sync = GradientSync({devs: b for devs, (b, _) in last.buckets.items()}, tuple(last.tensors))
    return Lowered(graph, strategy, dict(last.partitions), shards, dict(last.by_op),
                   DeviceBytes(*map(tuple, last.totals)), sync)


def _changed(last: "_Last | None", configs: tuple[tuple[str, Any], ...]) -> list[str] | None:
    """The ops whose config is not the very object of the last call's plan, or None when
    the plans do not name the same ops in the same order. One C-level pass finds the
    (name, config) pairs that are not the last plan's (``Strategy.replace`` makes one)."""
    if last is None or len(last.configs) != len(configs):
        return None
    before = last.configs
    out = []
    for i in itertools.compress(range(len(configs)), map(operator.is_not, before, configs)):
        (name, a), (other, b) = before[i], configs[i]
        if name != other:
            return None
        if a is not b:
            out.append(name)
    return out


def _update(graph: OpGraph, strategy: Strategy, cache: dict, last: "_Last", affected: list[OpNode]) -> None:
    """``last`` made ``strategy``'s lowering: the ``affected`` ops' pieces, in graph order, the
    shards of every weight they read (before or now) and the totals."""
    m = strategy.microbatches
    kept, received, received_grad = last.totals[:3]
    config = strategy.__getitem__
    weights: set[str] = set()  # read by an affected op, before or now
    regroup = last.readers is None  # an op reads other weights than before: readers are gathered again
    for node in affected:
        key = (node.name, m, strategy.num_devices, config(node.name), tuple(map(config, node.inputs)))
        pieces = cache.get(key)
        if pieces is None:
            strategy.validate_op(node)
            pieces = cache[key] = _lower_op(graph, strategy, node, m)
        old = last.by_op.get(node.name)
        if old is pieces:
            continue
        _patch(kept, old and old.activations, pieces.activations)
        _patch(received, old and old.receives[0], pieces.receives[0])
        _patch(received_grad, old and old.receives[1], pieces.receives[1])
        last.by_op[node.name] = pieces
        last.partitions[node.name] = pieces.partitions
        weights.update(pieces.weights_read)
        if old is not None:
            weights.update(old.weights_read)
            regroup = regroup or old.weights_read != pieces.weights_read
    if regroup:
        last.regroup(graph)
        weights = set(last.readers) | set(last.held)
    for name in weights:
        last.hold(name, cache)
    if regroup:
        last.held = {name: last.held[name] for name in last.readers}  # the readers' order


class _Held(NamedTuple):
    """One weight's shards, given the pieces of the ops reading it (``read_by``, kept so the
    cache's key by their ids stays sound), and what they add to the per-device totals."""

    read_by: tuple[OpPieces, ...]
    shards: list[WeightShard]
    per_device: tuple[int, ...]
    """Bytes of the shards each device holds."""
    buckets: dict[tuple[int, ...], int]
    """Trainable only: bytes of the shards replicated on exactly each device set of > 1 devices."""
    holders: tuple[int, ...]
    """Trainable only: the devices holding a shard."""


class _Last:
    """The previous call's lowering of one graph (per micro-batch and device count), which the
    next call patches: each op's pieces, each weight's shards (in the order their first reader
    comes in the graph) and the per-device totals over them."""

    def __init__(self, graph: OpGraph, n: int):
        self.configs: tuple = ()
        self.position = {node.name: i for i, node in enumerate(graph)}
        self.by_op: dict[str, OpPieces] = {}
        self.partitions: dict[str, tuple[tuple[Partition, ...], ...]] = {}
        self.readers: dict[str, list[str]] | None = None
        """Weight -> the ops reading it, in graph order."""
        self.held: dict[str, _Held] = {}
        self.totals = [[0] * n for _ in DeviceBytes._fields]
        self.buckets: dict[tuple[int, ...], list[int]] = {}
        """Device set -> [bytes, weights with a shard there] (``GradientSync.buckets``)."""
        self.tensors = [0] * n

    def regroup(self, graph: OpGraph) -> None:
        self.readers = {}
        for node in graph:
            for name in self.by_op[node.name].weights_read:
                self.readers.setdefault(name, []).append(node.name)

    def hold(self, name: str, cache: dict) -> None:
        """Weight ``name``'s shards for its readers' current pieces, the totals patched."""
        read_by = tuple(self.by_op[op] for op in self.readers.get(name, ()))
        old = self.held.get(name)
        if old is not None and len(old.read_by) == len(read_by) and all(map(operator.is_, old.read_by, read_by)):
            return
        new = None
        if read_by:
            key = ("shards", name, *map(id, read_by))
            new = cache.get(key)
            if new is None:
                new = cache[key] = _weight_shards(name, read_by, len(self.tensors))
        trainable, frozen = self.totals[3:]
        for h, sign in ((old, -1), (new, 1)):
            if h is None:
                continue
            total = trainable if h.shards[0].trainable else frozen
            for d, b in enumerate(h.per_device):
                total[d] += sign * b
            for d in h.holders:
                self.tensors[d] += sign
            for devs, b in h.buckets.items():
                entry = self.buckets.setdefault(devs, [0, 0])
                entry[0] += sign * b
                entry[1] += sign
                if not entry[1]:
                    del self.buckets[devs]
        if new is None:
            self.held.pop(name, None)
        else:
            self.held[name] = new


def _patch(total: list[int], old: tuple[int, ...] | None, new: tuple[int, ...]) -> None:
    """total += new - old, per device (old None: nothing to take back)."""
    if old is None:
        for d, b in enumerate(new):
            if b:
                total[d] += b
        return
    for d, (a, b) in enumerate(zip(old, new)):
        if a != b:
            total[d] += b - a


def _weight_shards(name: str, read_by: tuple[OpPieces, ...], n: int) -> _Held:
    """The shards of weight ``name`` read by ``read_by`` and what they add to the totals of the
    ``n`` devices."""
    held: dict[Box, set[int]] = {}
    ops: dict[str, None] = {}
    for pieces in read_by:
        for w, region, device, reader, itemsize, trainable in pieces.weight_reads:
            if w == name:
                held.setdefault(region, set()).add(device)
                ops[reader] = None
                meta = (itemsize, trainable)
    shards = _shards(name, held, *meta, tuple(ops))
    per_device = [0] * n
    buckets: dict[tuple[int, ...], int] = {}
    for s in shards:
        for d in s.devices:
            per_device[d] += s.nbytes
        if s.trainable and len(s.devices) > 1:
            buckets[s.devices] = buckets.get(s.devices, 0) + s.nbytes
    holders = tuple(sorted({d for s in shards for d in s.devices})) if meta[1] else ()
    return _Held(read_by, shards, tuple(per_device), buckets, holders)


def _lower_op(graph: OpGraph, strategy: Strategy, node: OpNode, m: int) -> OpPieces:
    cfg = strategy[node.name]
    rule = get_rule(node.kind)
    n = strategy.num_devices
    per_mb, transfers, reductions, reads = [], [], [], []
    couples: set[tuple[int, int]] = set()
    kept, fwd, grad = [0] * n, [0] * n, [0] * n
    sources = [(graph[src], strategy[src]) for src in node.inputs]
    moves_grad = [graph.needs_grad[src] and graph.needs_grad[node.name] for src in node.inputs]
    itemsize, loss, reads_weights = DTYPE_BYTES[node.output.dtype], node.kind == "loss", node.kind not in WEIGHT_KINDS
    for j in range(m):
        parts = []
        grids = [_grid(p, c.degrees, j, m) for p, c in sources]
        for k, box in enumerate(_boxes(_grid(node, cfg.degrees, j, m), cfg.degrees)):
            ins = rule.input_regions(node, box)
            ws = rule.weight_regions(node, box)
            dev = cfg.devices[k]
            parts.append(Partition(node.name, k, j, dev, box, tuple(ins),
                                   tuple((w.role, ws[w.role]) for w in node.weights)))
            if j == 0:
                kept[dev] += 8 if loss else itemsize * box_numel(box)  # kept for backward
                if reads_weights:
                    reads.extend((w.name, ws[w.role], dev, node.name, DTYPE_BYTES[w.spec.dtype],
                                  w.trainable) for w in node.weights)
            for slot, region in enumerate(ins):
                if region is None:
                    continue
                producer, pcfg = sources[slot]
                if producer.kind in WEIGHT_KINDS:
                    if j == 0:
                        w = producer.weights[0]
                        reads.append((w.name, region, dev, node.name, DTYPE_BYTES[w.spec.dtype],
                                      w.trainable))
                    continue
                size, src, devices = DTYPE_BYTES[producer.output.dtype], producer.name, pcfg.devices
                for q, piece, numel in _overlaps(grids[slot], pcfg.degrees, region):
                    src_dev, nbytes = devices[q], numel * size
                    # the hot loop: a Transfer made as the tuple it is (no Python-level __new__)
                    transfers.append(_new(Transfer, (src, q, node.name, k, slot, j, src_dev, dev, piece, nbytes)))
                    if src_dev != dev:
                        couples.add((src_dev, dev))
                        if j == 0:  # a remote piece: received, kept for backward, its gradient sent back
                            kept[dev] += nbytes
                            fwd[dev] += nbytes
                            if moves_grad[slot]:
                                grad[src_dev] += nbytes
        per_mb.append(tuple(parts))
        reductions.extend(_groups(node, cfg.degrees, cfg.devices, rule.reductions(node, cfg.degrees),
                                  parts, j, m, n, node.name in graph.outputs))
    for g in reductions:  # a collective couples its devices both ways
        couples.update(zip(g.devices, g.devices[1:] + g.devices[:1]))
    return OpPieces(tuple(per_mb), tuple(transfers), tuple(reductions), tuple(reads),
                    tuple(dict.fromkeys(r[0] for r in reads)), frozenset(couples), tuple(kept),
                    (tuple(fwd), tuple(grad)))


def _groups(node: OpNode, degrees: Sequence[int], devices: Sequence[int], reds, parts,
            microbatch: int, m: int, num_devices: int, output: bool) -> list[ReductionGroup]:
    out = []
    for red in reds:
        when = gates(node, red, parts, m, num_devices, output)
        over = set(red.over)
        groups: dict[tuple, list[int]] = {}
        for k in range(len(parts)):
            c = partition_index(k, degrees)
            groups.setdefault(tuple(x for i, x in enumerate(c) if i not in over), []).append(k)
        for members in groups.values():
            if len(members) > 1:
                sent, grad = _reduction_bytes(node, red.name, parts[members[0]].box, when)
                out.append(ReductionGroup(node.name, red.name, microbatch, tuple(members),
                                          tuple(devices[k] for k in members), sent, when, grad))
    return out


def _shards(name: str, regions: dict[Box, set[int]], itemsize: int, trainable: bool,
            ops: tuple[str, ...]) -> list[WeightShard]:
    """Weight regions with the devices holding each. Regions that partly overlap are cut into
    the cells their boundaries make, so each cell's replica group is exact."""
    boxes = list(regions)
    disjoint = all(a == b or intersect(a, b) is None for a, b in itertools.combinations(boxes, 2))
    if not disjoint:
        cuts = [sorted({x for b in boxes for x in b[i]}) for i in range(len(boxes[0]))]
        cells: dict[Box, set[int]] = {}
        for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
            devs = {d for b, ds in regions.items() if intersect(cell, b) == cell for d in ds}
            if devs:
                cells[tuple(cell)] = devs
        regions = cells
    return [WeightShard(name, box, tuple(sorted(devs)), math.prod(b - a for a, b in box) * itemsize,
                        ops, trainable)
            for box, devs in regions.items()]
