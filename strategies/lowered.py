"""What a lowering produces: the records of a plan's partitions, transfers, weight shards and
reductions, each op's ``OpPieces`` and the ``Lowered`` plan that gathers them
(``strategies.lowering.lower`` makes it)."""

from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple, Sequence

from strategies.errors import PlanError
from strategies.graph import DTYPE_BYTES, OpGraph
from strategies.members import members
from strategies.region import Box, box_numel, intersect
from strategies.precision import reduce_scale
from strategies.strategy import Strategy

if TYPE_CHECKING:
    from strategies.symmetry import Copies

__all__ = ["WEIGHT_KINDS", "Gate", "Partition", "Transfer", "Collective", "CollectiveRead", "COLLECTIVE_KINDS",
           "WeightRead", "WeightShard", "BucketKey", "bucket_key", "FIRST_BUCKET_BYTES", "split_buckets", "weight_shards", "ReductionGroup", "OpPieces",
           "DeviceBytes", "GradientSync", "Lowered"]

WEIGHT_KINDS = ("parameter", "constant")


class Gate(str, enum.Enum):
    """What waits on a reduction's sum (``ReductionGroup.gates``; ``strategies.pieces.gates``
    says which): the partitions' outputs (FORWARD), the loss partitions' backward (BACKWARD)
    or only the end of the step (STEP). A str, equal to its value. (What a simulated task is,
    forward or backward, is ``simulator.taskgraph.TaskKind``.)"""

    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"

    def __str__(self) -> str:
        return self.value


class Partition(NamedTuple):
    """Partition ``index`` of ``op`` for ``microbatch``: on ``device`` it computes ``box`` (one
    range per dim of the op, reduction dims included), reading ``input_regions`` (one per
    input; None: nothing) and ``weight_regions`` (the roles it reads: a row-parallel linear's
    bias only where its in_features range starts at 0)."""

    op: str
    index: int
    microbatch: int
    device: int
    box: Box
    input_regions: tuple[Box | None, ...]
    weight_regions: tuple[tuple[str, Box], ...]
    output: Box
    """The region of the op's output it holds: ``box``'s first ``len(output.shape)``
    coordinates (``OpNode.output_region``; ``box`` itself for an op with no reduction dims).
    Partitions that hold one output region on different coordinates of a cut reduction dim
    each hold a Partial sum of it (DTensor's ``Partial("sum")``); its consumers add them
    (``Transfer.partial``)."""


class Transfer(NamedTuple):
    """Bytes of ``src_op``'s partition ``src_index`` that ``dst_op``'s partition ``dst_index``
    reads as its input ``slot``. Backward moves the same region's gradient from dst to src
    where both ops carry one (``OpGraph.moves_grad``).
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
    partial: bool = False
    """The source holds a Partial sum of ``region`` (its op's reduction dims are cut): the
    consumer adds the pieces of every holder instead of copying one (a reduce when it is on one
    device; where its readers form an all-reduce or a reduce-scatter the lowering emits a
    ``Collective`` instead). Backward: each holder receives the whole gradient of ``region``
    (the gradient of a sum is the same for every term)."""

    @property
    def local(self) -> bool:
        return self.src_device == self.dst_device


COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
"""What a ``Collective`` does forward; its backward is ``Collective.backward_kind``."""


class Collective(NamedTuple):
    """One collective over the device group ``devices`` (sorted) that moves region ``region``
    of ``op``'s output in ``microbatch``, replacing the point-to-point pieces its readers would
    otherwise read (``strategies.collectives`` finds the patterns). Member i holds producer
    partition ``holders[i]``, and after the call it has:

    - ``all_reduce``: Σ over the members of their Partial sums of ``region`` (every holder's
      output region is ``region``): all of it;
    - ``reduce_scatter``: that sum's chunk i along ``dim`` (``region`` cut in n equal chunks,
      chunk i for member i, as torch's ``reduce_scatter_tensor`` gives group rank i chunk i);
    - ``all_gather``: all of ``region``, whose chunk i along ``dim`` member i held (a Shard).

    One collective serves every consumer op that reads the same region of the same producer
    partitions (its ``CollectiveRead``s). Backward, where ``grad`` (``OpGraph.moves_grad``),
    the dual collective moves the gradient back: all_reduce ↔ all_reduce (Megatron-LM's f/g),
    reduce_scatter ↔ all_gather."""

    kind: str
    op: str
    microbatch: int
    devices: tuple[int, ...]
    holders: tuple[int, ...]
    region: Box
    dim: int | None
    """The dim ``region`` is chunked along (reduce_scatter, all_gather); None for all_reduce."""
    nbytes: int
    """Bytes of ``region``: the whole tensor the collective reduces or gathers."""
    grad: bool
    """The gradient moves back (the dual collective runs in the backward pass)."""

    @property
    def backward_kind(self) -> str:
        return {"all_reduce": "all_reduce", "reduce_scatter": "all_gather",
                "all_gather": "reduce_scatter"}[self.kind]

    def chunk(self, i: int) -> Box:
        """Member i's chunk of ``region`` along ``dim`` (``region`` itself for all_reduce)."""
        if self.dim is None:
            return self.region
        lo, hi = self.region[self.dim]
        w = (hi - lo) // len(self.devices)
        return self.region[:self.dim] + ((lo + i * w, lo + (i + 1) * w),) + self.region[self.dim + 1:]

    def result(self, i: int) -> Box:
        """The region member i holds after the forward call."""
        return self.chunk(i) if self.kind == "reduce_scatter" else self.region

    @property
    def sent(self) -> int:
        """Bytes each member sends in a ring (Patarasuk & Yuan 2009): (n−1)/n · ``nbytes`` for
        a reduce-scatter or an all-gather, twice that for an all-reduce (the two one after the
        other)."""
        n = len(self.devices)
        once = (n - 1) * self.nbytes // n
        return 2 * once if self.kind == "all_reduce" else once


class CollectiveRead(NamedTuple):
    """Partition ``dst_index`` of ``dst_op`` (on ``device``) reads its input ``slot`` from
    ``collective``: what member ``device`` holds after it (``Collective.result``)."""

    collective: Collective
    dst_op: str
    dst_index: int
    slot: int
    device: int


class WeightRead(NamedTuple):
    """Partition of ``op`` on ``device`` reads ``region`` of weight ``name`` (its dtype and
    whether it is trainable: the same for every read of that weight)."""

    name: str
    region: Box
    device: int
    op: str
    dtype: str
    trainable: bool
    zero: int = 0
    """The reading op's sharding level (``ParallelConfig.zero``; a weight read through a
    ``parameter`` op's output: the larger of the reader's and that op's)."""


@dataclass(frozen=True)
class WeightShard:
    """A region of one weight held on ``devices``; with several devices its gradient is
    summed over exactly them (``bucket_key``). ``ops`` are the ops reading it (a tied
    weight: several)."""

    name: str
    region: Box
    devices: tuple[int, ...]
    nbytes: int
    ops: tuple[str, ...]
    dtype: str
    trainable: bool = True
    zero: int = 0
    """Its sharding level (ZeRO stage; ``strategies.zero``): the largest ``zero`` of the ops
    reading the weight, 0 where the shard is held by one device or is not trainable (nothing
    to shard: a documented no-op)."""

    @cached_property
    def bucket_group(self) -> "BucketKey | None":
        """``bucket_key`` of this shard, computed once (a lowering's cache reuses its shards) and
        one object for equal keys, so ``split_buckets`` can key its groups by identity."""
        key = bucket_key(self)
        return None if key is None else _GROUPS.setdefault(key, key)


class BucketKey(NamedTuple):
    """A gradient bucket: trainable shards replicated on exactly ``devices`` whose dtype is
    ``dtype`` and whose sharding level is ``zero``, packed into one flat tensor and summed once
    (DDP's buckets, Li et al. 2020, hold one dtype each: a flat tensor has one): all-reduced at
    level 0, reduce-scattered in ``strategies.zero``'s chunks at levels 1 and 2. ``index``:
    which of its group's buckets (``split_buckets``: the shards of one (devices, dtype, zero)
    cut at the plan's ``bucket_cap_mb``, 0 the first formed, holding the last weights)."""

    devices: tuple[int, ...]
    dtype: str
    zero: int = 0
    index: int = 0


def bucket_key(shard: WeightShard) -> BucketKey | None:
    """The bucket group ``shard``'s gradient is summed in, as the key of its first bucket
    (index 0): one per (device set, dtype, level) of the trainable shards held on more than
    one device; None: its gradient is summed nowhere. ``split_buckets`` cuts each group into
    the buckets the simulator times (``GradientSync.buckets``) and the executor runs."""
    if shard.trainable and len(shard.devices) > 1:
        return BucketKey(shard.devices, shard.dtype, shard.zero)
    return None


_GROUPS: dict[BucketKey, BucketKey] = {}
"""Each bucket group's one key object (``WeightShard.bucket_group``)."""

FIRST_BUCKET_BYTES = 1 << 20
"""The first bucket's limit where the cap is larger: DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``
(1 MiB, so the first all-reduce starts early in the backward)."""


def split_buckets(shards: Sequence[WeightShard], cap: int, strategy: Strategy | None = None
                  ) -> tuple[dict[BucketKey, int], tuple[BucketKey | None, ...]]:
    """The gradient buckets of ``shards`` (``Lowered.weight_shards`` order) at a cap of ``cap``
    bytes, as DDP assigns them (torch.distributed's ``_compute_bucket_assignment_by_size``):
    each group's (``bucket_key``) shards taken in reverse order (DDP's reverse order of
    ``model.parameters()``: the gradients a backward pass makes first), each added to its
    group's open bucket, which closes once its bytes reach its limit, min(1 MiB, cap) for the
    group's first bucket (``FIRST_BUCKET_BYTES``), ``cap`` for the others; bucket i is index i.
    Levels 2 and 3 are reduce-scattered per use (``strategies.zero``): one key per group.
    A bucket's bytes are counted against its limit in the dtype it is reduced in
    (``strategies.precision.reduce_scale`` under ``strategy``: float32 buckets fill at half the
    bf16 gradients). Returns bucket -> bytes (in the shards' dtype), and each shard's bucket
    (None: summed nowhere), in ``shards``' order."""
    first = min(FIRST_BUCKET_BYTES, cap)
    wide = {}  # a group's key -> bytes reduced per byte held
    if strategy is not None and strategy.reduce_dtype != "compute":
        wide = {g: reduce_scale(strategy, g.dtype) for g in {s.bucket_group for s in shards} if g is not None}
    open_: dict[int, list] = {}  # id of a group (one object per key) -> [its open bucket, bytes in it]
    sizes: dict[BucketKey, int] = {}
    of: list[BucketKey | None] = [None] * len(shards)
    for i in range(len(shards) - 1, -1, -1):
        s = shards[i]
        group = s.bucket_group
        if group is None:
            continue
        entry = open_.get(id(group))
        if entry is None:
            entry = open_[id(group)] = [group, 0]
        key = of[i] = entry[0]
        entry[1] += s.nbytes
        if entry[1] * wide.get(group, 1) >= (cap if key.index else first) and group.zero < 2:
            sizes[key] = entry[1]
            entry[0], entry[1] = BucketKey(group.devices, group.dtype, group.zero, key.index + 1), 0
    for key, b in open_.values():
        if b:
            sizes[key] = b
    return sizes, tuple(of)


def weight_shards(name: str, regions: dict[Box, set[int]], dtype: str, trainable: bool,
                  ops: tuple[str, ...], zero: int = 0) -> list[WeightShard]:
    """The shards of weight ``name``: each region read, with the devices reading it, in the order
    given. Where two regions partly overlap, every region is cut into the cells the boundaries
    of all of them make, so that each shard's devices are exactly those holding all of it (its
    gradient is summed over exactly them). ``zero``: the weight's sharding level, kept on the
    shards held by several devices (``WeightShard.zero``)."""
    boxes = list(regions)
    if any(a != b and intersect(a, b) is not None for a, b in itertools.combinations(boxes, 2)):
        cuts = [sorted({x for b in boxes for x in b[i]}) for i in range(len(boxes[0]))]
        cells: dict[Box, set[int]] = {}
        for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
            devs = {d for b, ds in regions.items() if intersect(cell, b) == cell for d in ds}
            if devs:
                cells[tuple(cell)] = devs
        regions = cells
        if zero >= 2 and trainable:
            raise PlanError(ops[0], "zero", zero, f"weight {name!r} is read in regions that partly overlap: level "
                            f"{zero} reduce-scatters each region a partition reads as one shard; cut the weight alike "
                            "on every reader")
    if zero and trainable:
        _check_level(name, regions, ops, zero)
    itemsize = DTYPE_BYTES[dtype]
    return [WeightShard(name, box, members(devs), box_numel(box) * itemsize, ops, dtype, trainable,
                        zero if trainable and len(devs) > 1 else 0)
            for box, devs in regions.items()]


def _check_level(name: str, regions: dict[Box, set[int]], ops: tuple[str, ...], zero: int) -> None:
    """PlanError unless sharding level ``zero`` can run on weight ``name``'s regions: a level
    shards every region of the weight over its replicas, so either all its regions are
    replicated or none is (all on one device each: a no-op)."""
    single = sorted(min(ds) for ds in regions.values() if len(ds) == 1)
    if len(single) == len(regions):
        return
    if single:
        raise PlanError(ops[0], "zero", zero, f"weight {name!r} has regions held by one device (on devices "
                        f"{single}) and regions replicated on several: a sharding level chunks every region of a "
                        "weight over its replicas; cut the weight alike on every replica or set zero 0")


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
    gates: Gate = Gate.FORWARD
    """What waits on the sum (``Gate``)."""
    grad_nbytes: int = 0
    """One member's contribution to the backward sum (0: the backward sums nothing)."""


class OpPieces(NamedTuple):
    """What one op contributes to a lowering; a function of its config, its producers' configs
    and the micro-batch count only, so a search can reuse it for every unchanged op."""

    partitions: tuple[tuple[Partition, ...], ...]
    transfers: tuple[Transfer, ...]
    reductions: tuple[ReductionGroup, ...]
    weight_reads: tuple[WeightRead, ...]
    """The weight regions its partitions of micro-batch 0 read (the weights' shards follow)."""
    weights_read: tuple[str, ...]
    """The weight names in ``weight_reads``, once each."""
    couples: frozenset[tuple[int, int]]
    """Device pairs (a, b) where a's data flows to b: remote transfers into the op, and each
    reduction's ring in both directions (``strategies.schedule.warmups`` reads them)."""
    activations: tuple[int, ...]
    """Bytes each device keeps for backward per micro-batch (one entry per device): each
    partition's output (unless ``dropped``), a dropout's mask (``strategies.saved``) and each
    remote piece it receives (a recompute op keeps those too: its recomputation's inputs;
    ``simulator.memory``); a weight op's none (its output is its weight, held once:
    ``MemoryBreakdown.weights``)."""
    receives: tuple[tuple[int, ...], tuple[int, ...]]
    """(forward, gradient) bytes each device receives per micro-batch (one entry per device):
    the remote pieces into the op on their consumer's device, and their gradients on the
    producer's device when both ops need one (the executor posts them a micro-batch ahead;
    ``simulator.memory``). A collective's buffers are the plan's, not an op's
    (``strategies.collective_buffers``): several consumer ops share one."""
    collective_reads: tuple[CollectiveRead, ...] = ()
    """The inputs its partitions read from collectives instead of point-to-point pieces."""
    recompute: bool = False
    """The op recomputes its forward before its backward (``ParallelConfig.recompute``)."""
    dropped: tuple[int, ...] = ()
    """Bytes each device drops per micro-batch instead of keeping (one entry per device, empty:
    none): a recompute op's partition outputs where every consumer op recomputes too or reads
    nothing back (``strategies.drops.drops_output``), or, with ``recompute`` false, outputs no
    backward reads (``strategies.drops.transient``); not in ``activations``."""


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

    buckets: dict[BucketKey, int]
    """Gradient bucket (``split_buckets``) -> bytes of the shards in it (one all-reduce each,
    ``simulator.step``)."""
    tensors: tuple[int, ...]
    """Trainable weights each device holds a shard of (one entry per device)."""
    shard_buckets: tuple[BucketKey | None, ...]
    """The bucket each of ``Lowered.weight_shards`` has its gradient summed in (``split_buckets``;
    None: summed nowhere), in that order."""


_transfers, _reductions = operator.attrgetter("transfers"), operator.attrgetter("reductions")


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
    copies: "Copies | None" = None
    """None: every device's partitions. Else the lowering of these copies' copy 0 only
    (``strategies.lowering_copies``): copy 0's partitions, transfers and collectives; reduction
    groups, weight shards and buckets whole; ``device_bytes`` and ``gradient_sync.tensors`` of
    every device. ``check_whole`` refuses it where every device's partitions are needed."""
    twins: dict[str, tuple[str, OpPieces, int]] = field(default_factory=dict, compare=False, repr=False)
    """Op -> (op T, T's pieces, delta) where the op's pieces are T's renamed (``strategies.lowering_shared``:
    one shape, one config; delta 0) or renamed and every device moved delta on (``relative_key``:
    T's layer in another pipeline stage), for T's pieces that object: what is built from T's
    pieces may be renamed and moved for the op (``simulator.twins``). Not part of the lowering's value."""

    def check_whole(self, what: str) -> None:
        """PlanError unless this lowering holds every device's partitions (``copies`` None)."""
        if self.copies is not None:
            raise PlanError(None, "copies", str(self.copies), f"{what} needs every device's partitions; this "
                            "lowering holds copy 0's only (lower it with copies=None)")

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every op's transfers, in graph order (gathered when first read)."""
        return tuple(itertools.chain.from_iterable(map(_transfers, self.pieces.values())))

    @cached_property
    def reductions(self) -> tuple[ReductionGroup, ...]:
        """Every op's reduction groups, in graph order (gathered when first read)."""
        return tuple(itertools.chain.from_iterable(map(_reductions, self.pieces.values())))

    @cached_property
    def collectives(self) -> tuple[Collective, ...]:
        """Every collective once, in the graph order of its first reader op (a consumer op's in
        micro-batch, input and partition order): the order in which each member calls them
        (``strategies.schedule.collective_calls``); ``collective_readers``' keys."""
        return tuple(self.collective_readers)

    @cached_property
    def collective_readers(self) -> dict[Collective, tuple[CollectiveRead, ...]]:
        """Collective -> every read of it, in graph order (the collectives in the order of their
        first read)."""
        out: dict[Collective, list[CollectiveRead]] = {}
        last = rs = None
        for p in self.pieces.values():
            for r in p.collective_reads:
                c = r.collective
                if c is not last:  # an op's partitions that read one collective read one object: hashed once
                    rs, last = out.setdefault(c, []), c
                rs.append(r)
        return {c: tuple(rs) for c, rs in out.items()}

    @property
    def bytes_moved(self) -> int:
        """Forward bytes crossing links: the remote point-to-point pieces and what the
        collectives' members send (``Collective.sent``). Backward moves as many again, less the
        pieces and collectives whose gradient does not move (``OpGraph.moves_grad``)."""
        return (sum(t.nbytes for t in self.transfers if not t.local)
                + sum(c.sent * len(c.devices) for c in self.collectives))
