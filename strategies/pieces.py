"""One op's share of a lowering (``OpPieces``): its partitions, the transfers into them, its
reduction groups and the weight regions it reads, from its config, its producers' configs and
the micro-batch count only. Coordinates are global: a partition of micro-batch j covers rows
[j·B/m + c·B/(m·d), ...) of the sample dim (B batch, m micro-batches, d the sample degree)."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Sequence

from strategies.errors import PlanError
from strategies.graph import DTYPE_BYTES, OpGraph, OpNode
from strategies.collectives import find_collectives
from strategies.drops import check_recompute, drops_output, transient
from strategies.lowered import (WEIGHT_KINDS, CollectiveRead, Gate, OpPieces, Partition, ReductionGroup, Transfer,
                                WeightRead)
from strategies.region import Box, box_numel, partition_index
from strategies.series import Microbatch, microbatches
from strategies.saved import aliases, saved_extra
from strategies.rules import get_rule
from strategies.rules.base import Reduction
from strategies.rules.cross_entropy import CLASS_SUMS, class_sum_terms
from strategies.strategy import Strategy
from strategies.symmetry import CrossCopy
from strategies.lowering_copies import kept_indices, reduction_members
from strategies.lowering_members import MemberKeep, member_reads, other_partitions, other_reads
from strategies.lowering_shared import shapes_of

__all__ = ["lower_op", "partition_box_mb", "box_at", "grid_of", "overlapping", "gates", "check_microbatches", "shape_ids"]

_new = tuple.__new__
_name = operator.attrgetter("name")


def grid_of(node: OpNode, degrees: Sequence[int], microbatch: int = 0,
            microbatches: int = 1) -> tuple[tuple[int, int], ...]:
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


_SHAPE_IDS: "weakref.WeakKeyDictionary[OpGraph, dict[str, int]]" = weakref.WeakKeyDictionary()


_CHECKED: "weakref.WeakKeyDictionary[OpGraph, set[int]]" = weakref.WeakKeyDictionary()
"""Graph -> the micro-batch counts ``check_microbatches`` passed (kept while the graph lives)."""


def shape_ids(graph: OpGraph) -> dict[str, int]:
    """``strategies.lowering_shared.shapes_of`` ``graph``, found once per graph (kept while it lives)."""
    shapes = _SHAPE_IDS.get(graph)
    if shapes is None:
        shapes = _SHAPE_IDS[graph] = shapes_of(graph)
    return shapes


def check_microbatches(graph: OpGraph, m: int) -> None:
    """Raise PlanError unless every op's micro-batch j reads only micro-batch j of each producer
    with a sample dim (rows [j·P/m, (j+1)·P/m) of it), as ``lower_op`` assumes: a reshape that
    flattens the batch inside another dim (x.permute(1, 0, 2).reshape(-1, H)) mixes samples
    across micro-batches, and its plans would move only part of what it reads. Ops of one
    shape (``shape_ids``) are checked once (the check reads the op and its producers' kinds,
    dims and sample dims, which the id holds)."""
    if m == 1:
        return
    checked = _CHECKED.setdefault(graph, set())
    if m in checked:  # a function of the graph and m alone: a search lowers at a few counts again and again
        return
    shapes, seen = shape_ids(graph), set()  # ids of the shapes checked
    for node in graph:
        if shapes[node.name] in seen:
            continue
        seen.add(shapes[node.name])
        i = node.sample_dim
        if i is None or not node.inputs or node.shape[i] % m:
            continue  # no micro-batches here, or one the config checks refuse with their own message
        rule = get_rule(node.kind)
        span = node.shape[i] // m
        for j in range(m):
            box = tuple((j * span, (j + 1) * span) if d == i else (0, size) for d, size in enumerate(node.shape))
            try:
                regions = rule.input_regions(node, box)
            except ValueError as e:
                raise PlanError(node.name, "microbatches", m, f"micro-batch {j} of it is not a box of its input "
                                f"({e}); train it with 1 micro-batch") from None
            for src, region in zip(node.inputs, regions):
                p = graph[src]
                k = p.sample_dim
                if region is None or k is None or p.kind in WEIGHT_KINDS:
                    continue
                lo, hi = j * p.shape[k] // m, (j + 1) * p.shape[k] // m
                if region[k][0] < lo or region[k][1] > hi:
                    raise PlanError(node.name, "microbatches", m,
                                    f"its micro-batch {j} reads [{region[k][0]}, {region[k][1]}) of {src!r}'s "
                                    f"sample dim ({p.shape[k]}), outside that op's micro-batch {j} [{lo}, {hi}): "
                                    "it does not keep the samples apart (the batch is not the outer part of "
                                    "the dim it is flattened into); train it with 1 micro-batch")
    checked.add(m)


def partition_box_mb(node: OpNode, degrees: Sequence[int], k: int, microbatch: int,
                     microbatches: int) -> Box:
    """The global region partition ``k`` of ``node`` computes in ``microbatch``."""
    return box_at(grid_of(node, degrees, microbatch, microbatches), degrees, k)


def box_at(grid: Sequence[tuple[int, int]], degrees: Sequence[int], k: int) -> Box:
    """Partition ``k``'s box on ``grid`` (``grid_of``)."""
    return tuple((b + c * st, b + (c + 1) * st) for (b, st), c in zip(grid, partition_index(k, degrees)))


@functools.lru_cache(maxsize=1 << 16)
def overlapping(grid: tuple[tuple[int, int], ...], degrees: tuple[int, ...],
                region: Box) -> tuple[tuple[int, Box, int], ...]:
    """(index, the part of ``region`` it holds, that part's elements) of each partition whose
    box overlaps ``region``, in partition order. Per dim the grid is regular: the overlapping
    coordinates are a range and each one's cut of the region an interval, so no box is
    intersected (coordinate c of a dim covers [base + c·step, base + (c+1)·step), ``grid_of``).
    Memoized: a search asks again for the same producer grid and region (op shapes repeat)."""
    axes = []
    for (lo, hi), (base, step), d in zip(region, grid, degrees):
        first = (lo - base) // step
        last = (hi - 1 - base) // step
        if first < 0:
            first = 0
        if last > d - 1:
            last = d - 1
        if first > last:
            return ()
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
    return tuple(out)


def gates(node: OpNode, red: Reduction, devices: Sequence[int], m: int, num_devices: int,
          output: bool = True) -> Gate:
    """What must wait for reduction ``red`` of ``node``'s partitions on ``devices`` (one micro-batch);
    ``output``: ``node`` is the graph's output (a loss feeding another op must be whole first):

    - ``Gate.FORWARD``: the partitions' outputs (batch statistics; a loss that is not the output);
      their backward sums again.
    - ``Gate.STEP``: only the end of the step. A deferred sum (a loss: Σ w_i·ℓ_i and Σ w_i) whose divisor
      is known without data (``Loss.static_count``), or whose divisor C scales every gradient
      after the backward pass: one micro-batch (m = 1) with the loss on every device, so each
      device scales its own gradients by 1/C (gradients are linear in the seed).
    - ``Gate.BACKWARD``: the loss partitions' backward, seeded 1/(m·C_j) once C_j is known.
    """
    if not red.deferred or not output:
        return Gate.FORWARD
    static = get_rule(node.kind).static_count(node) is not None  # deferred: a loss rule
    everywhere = set(devices) == set(range(num_devices))
    return Gate.STEP if static or (m == 1 and everywhere) else Gate.BACKWARD


def lower_op(graph: OpGraph, strategy: Strategy, node: OpNode, m: int,
             keep: frozenset[int] | None = None) -> OpPieces:
    """What ``node`` contributes to ``strategy``'s lowering with ``m`` micro-batches. ``keep``:
    copy 0's devices (``strategies.symmetry``; None: all): a non-weight op's partitions
    elsewhere, the transfers and collectives into them and their weight reads are left out
    (a transfer into copy 0 from another copy: ``CrossCopy``); its reduction groups that
    hold a partition of copy 0 are whole (``strategies.lowering_copies``)."""
    cfg = strategy[node.name]
    rule = get_rule(node.kind)
    n = strategy.num_devices
    reads: list[WeightRead] = []
    kept, fwd, grad = [0] * n, [0] * n, [0] * n
    if cfg.recompute:
        check_recompute(graph, node)
    # a dropped (recomputed) or transient (never read again) output counts there instead
    drop = drops_output(graph, strategy, node.name) if cfg.recompute else transient(graph, strategy, node.name)
    dropped = [0] * n if drop else kept
    sources = [(graph[src], strategy[src]) for src in node.inputs]
    moves_grad = [graph.moves_grad(src, node.name) for src in node.inputs]
    itemsize, loss, is_weight = DTYPE_BYTES[node.output.dtype], node.kind == "loss", node.kind in WEIGHT_KINDS
    alias = aliases(node) and bool(node.inputs)
    out_ndim = len(node.output.shape)
    # per input: the full ranges of its producer's reduction dims (every holder of a Partial
    # region is a source) and whether they are cut (the pieces are Partial sums); a loss's
    # output is whole on every partition once its sums are done (its classes summed inside)
    sums = [tuple((0, p.shape[i]) for i in p.reduction_dims) if p.kind != "loss" else () for p, _ in sources]
    partial = [p.kind != "loss" and any(c.degrees[i] > 1 for i in p.reduction_dims) for p, c in sources]
    if node.kind in WEIGHT_KINDS:
        keep = None  # a weight op runs where its config says, in no copy
    kept_at = None if keep is None else kept_indices(cfg, keep)
    fold = keep if isinstance(keep, MemberKeep) else None  # members 0 and 1 lowered for all
    kept_set = frozenset(kept_at) if fold is not None else None
    spans: list[tuple[int, int, int]] = []  # a member fold's: (partition, its reads' start, end)

    def one(j: int) -> Microbatch:
        """Micro-batch ``j``'s pieces; micro-batch 0's weight reads, kept and moved bytes too."""
        transfers, collective_reads, couples = [], [], set()
        parts, weight_regions = [], []
        grids = [grid_of(p, c.degrees, j, m) for p, c in sources]
        grid = grid_of(node, cfg.degrees, j, m)
        others = () if fold is None else other_partitions(node, cfg, rule, fold, grid)
        for k, box in (enumerate(_boxes(grid, cfg.degrees)) if kept_at is None else
                       ((k, box_at(grid, cfg.degrees, k)) for k in kept_at)):
            ins = rule.input_regions(node, box)
            ws = rule.weight_regions(node, box)
            parts.append(Partition(node.name, k, j, cfg.devices[k], box, tuple(ins),
                                   tuple((w.role, ws[w.role]) for w in node.weights if w.role in ws), box[:out_ndim]))
            weight_regions.append(ws)
        # per input: each reader's overlapping producer partitions, and the reads that are collectives
        overlaps, shared = [], []
        for slot, (producer, pcfg) in enumerate(sources):
            extra = sums[slot]
            ov = [None if p.input_regions[slot] is None or producer.kind in WEIGHT_KINDS else
                  overlapping(grids[slot], pcfg.degrees, p.input_regions[slot] + extra if extra else p.input_regions[slot])
                  for p in parts]
            overlaps.append(ov)
            found = {}
            if len(pcfg.devices) > 1 and len(parts) + len(others) > 1 and producer.kind not in WEIGHT_KINDS:
                found = find_collectives(producer, pcfg.devices, pcfg.degrees, grids[slot], partial[slot], j,
                                         moves_grad[slot], [(p.index, p.device, p.input_regions[slot],
                                                             tuple(q for q, _, _ in o))
                                                            for p, o in zip(parts, ov) if o is not None]
                                         + other_reads(others, slot, grids[slot], pcfg.degrees, extra))
                if others:  # the other members read alike: the kept partitions' collectives only
                    found = {k: c for k, c in found.items() if k in kept_set}
            shared.append(found)
            for c in dict.fromkeys(found.values()):  # a collective couples its members both ways
                couples.update(zip(c.devices, c.devices[1:] + c.devices[:1]))
                couples.update(zip(c.devices[1:] + c.devices[:1], c.devices))
        for k, p in enumerate(parts):
            dev, ins = p.device, p.input_regions
            start = len(reads)
            if j == 0:
                numel = box_numel(p.output)
                # a view's output is its input's storage; a weight op's is its weight, held once
                # (MemoryBreakdown.weights), not per micro-batch: the executor reads it in place
                if not is_weight and not (alias and _one_piece(overlaps[0][k], shared[0].get(p.index))):
                    dropped[dev] += 8 if loss else itemsize * numel  # kept for backward (or dropped)
                if not cfg.recompute:  # a dropout's mask (recomputed with its output otherwise)
                    kept[dev] += saved_extra(node, numel)
                if not is_weight:
                    ws = weight_regions[k]
                    reads.extend(_new(WeightRead, (w.name, ws[w.role], dev, node.name, w.spec.dtype, w.trainable,
                                                     cfg.zero))
                                 for w in node.weights if w.role in ws)
            for slot, region in enumerate(ins):
                if region is None:
                    continue
                producer, pcfg = sources[slot]
                if producer.kind in WEIGHT_KINDS:
                    if j == 0:
                        w = producer.weights[0]
                        reads.append(_new(WeightRead, (w.name, region, dev, node.name, w.spec.dtype,
                                                       w.trainable, max(cfg.zero, pcfg.zero))))
                    continue
                c = shared[slot].get(p.index)
                if c is not None:
                    collective_reads.append(CollectiveRead(c, node.name, p.index, slot, dev))
                    continue
                size, src, devices = DTYPE_BYTES[producer.output.dtype], producer.name, pcfg.devices
                extra = sums[slot]
                for q, piece, numel in overlaps[slot][k]:
                    if extra:  # the output part of a box over the producer's reduction dims too
                        piece = piece[:len(region)]
                        numel = box_numel(piece)
                    src_dev, nbytes = devices[q], numel * size
                    if fold is not None and src_dev != dev and fold.member.get(src_dev) != fold.member[dev]:
                        raise CrossCopy(f"transfer {src}[{q}] -> {node.name}[{p.index}]: device {src_dev} -> {dev} "
                                        "crosses members; a member's transfers must stay among its own devices", node.name)
                    if keep is not None and src_dev not in keep:
                        raise CrossCopy(f"op {node.name!r} reads {src!r} on device {src_dev}, in another copy "
                                        f"than its partition {p.index} on device {dev}", node.name)
                    # the hot loop: a Transfer made as the tuple it is (no Python-level __new__)
                    transfers.append(_new(Transfer, (src, q, node.name, p.index, slot, j, src_dev, dev, piece, nbytes,
                                                     partial[slot])))
                    if src_dev != dev:
                        couples.add((src_dev, dev))
                        if j == 0:  # a remote piece: received, kept for backward, its gradient sent back
                            kept[dev] += nbytes
                            fwd[dev] += nbytes
                            if moves_grad[slot]:
                                grad[src_dev] += nbytes
            if fold is not None and j == 0:
                spans.append((p.index, start, len(reads)))
        return Microbatch(tuple(parts), tuple(transfers), tuple(collective_reads), frozenset(couples))

    # micro-batch j's pieces are micro-batch j - 1's with their sample rows moved on where the
    # op and every activation it reads have a sample dim (``check_microbatches``: each reads
    # within its own micro-batch's rows), so the interior ones may come from a series
    alike = node.sample_dim is not None and all(p.sample_dim is not None for p, _ in sources
                                                if p.kind not in WEIGHT_KINDS)
    reds = rule.reductions(node, cfg.degrees)
    per_mb, transfers, reductions, collective_reads = [], [], [], []
    couples: set[tuple[int, int]] = set()
    for j, got in enumerate(microbatches(one, m, alike)):
        per_mb.append(got.partitions)
        transfers += got.transfers
        collective_reads += got.reads
        couples |= got.couples
        if reds:
            reductions.extend(_groups(node, cfg.degrees, cfg.devices, reds, grid_of(node, cfg.degrees, j, m), j, m, n,
                                      node.name in graph.outputs, kept_at))
    if fold is not None:  # every member's weight reads (members 0 and 1 stand for the rest)
        reads = member_reads(node, cfg, rule, fold, sources, m, reads, spans)
    for g in reductions:  # a collective couples its devices both ways
        couples.update(zip(g.devices, g.devices[1:] + g.devices[:1]))
    return OpPieces(tuple(per_mb), tuple(transfers), tuple(reductions), tuple(reads),
                    tuple(dict.fromkeys(map(_name, reads))), frozenset(couples), tuple(kept),
                    (tuple(fwd), tuple(grad)), tuple(collective_reads), cfg.recompute,
                    tuple(dropped) if drop else ())


def _one_piece(pieces, collective) -> bool:
    """A view's input is one tensor, its output a view of that storage (counted where it is
    kept: its producer's output, or one received piece): its partition reads one piece and no
    collective's result. A view of a weight (no pieces) is the weight's storage."""
    return collective is None and (pieces is None or len(pieces) == 1)


def _groups(node: OpNode, degrees: Sequence[int], devices: Sequence[int], reds, grid, microbatch: int, m: int,
            num_devices: int, output: bool, kept_at: Sequence[int] | None = None) -> list[ReductionGroup]:
    """Each reduction's groups of two partitions or more, in the order of their first member;
    ``kept_at`` (copy 0's partitions, None: all): only the groups holding one, whole."""
    out = []
    for red in reds:
        when = gates(node, red, devices, m, num_devices, output)
        for members in reduction_members(tuple(degrees), tuple(red.over), kept_at):
            if len(members) > 1:
                sent, grad = _reduction_bytes(node, red.name, box_at(grid, degrees, members[0]), when)
                out.append(ReductionGroup(node.name, red.name, microbatch, tuple(members),
                                          tuple(devices[k] for k in members), sent, when, grad))
    return out


def _reduction_bytes(node: OpNode, name: str, box: Box, when: Gate) -> tuple[int, int]:
    """(forward, backward) bytes of one partition's contribution to a reduction, as the
    executor sends them. Batch statistics over C channels, in float32 (float64 for a float64
    tensor, as torch's batchnorm): forward (2C + 1) elements — mean, variance and the count —
    backward 2C — Σdy and Σdy·x̂ (SyncBatchNorm's). A loss, in its dtype: [s_p, c_p] (Σw·ℓ, Σw)
    when its divisor needs the data, s_p alone when it is static (``Loss.static_count``; a loss
    summed in the forward, ``Loss.forward``, sends s_p alone only for reduction="sum");
    nothing backward (the loss's backward has no collective), unless the sum gates the forward
    (a loss that is not the output: its backward sums the same elements). A cross-entropy's
    class shards (``strategies.rules.cross_entropy``), in the logits' dtype, per sample of the
    box: its max (class_max), and S, z_t, w_t with class weights, Σ w·z with label smoothing,
    plus Σ w once with both (class_sum); nothing backward (the gradient is local)."""
    if name in CLASS_SUMS:
        samples = box_numel(box[:-1])
        if name == "class_max":
            terms = samples
        else:
            weighted, smoothing = bool(node.weights), node.attrs.get("label_smoothing", 0.0) > 0
            terms = class_sum_terms(weighted, smoothing) * samples + int(weighted and smoothing)
        return terms * DTYPE_BYTES[node.input_specs[0].dtype], 0
    if name == "batch_stats" and len(box) > 1:
        size = 8 if node.output.dtype == "float64" else 4
        channels = box[1][1] - box[1][0]
        return (2 * channels + 1) * size, 2 * channels * size
    one = node.attrs["reduction"] == "sum" if when is Gate.FORWARD else get_rule(node.kind).static_count(node) is not None
    sums = (1 if one else 2) * DTYPE_BYTES[node.output.dtype]
    return sums, sums if when is Gate.FORWARD else 0
