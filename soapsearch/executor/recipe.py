"""What each partition of one rank does in a step, worked out once from the lowering, so that a
step does no region arithmetic: where each input comes from (which slices of which tensors,
which pieces arrive from which rank), what it sends, where its output gradient comes from and
which partitions share one autograd graph. Plain data, no process group: ``recipes`` is pure.

Autograd graphs (GPipe's per-stage graphs, Huang et al. 2019, cut only where they must be). A
consumer reads a producer's output through a leaf copy (``x.detach().requires_grad_()``) and the
producer's backward step calls autograd with the gradient its consumers' leaves collected,
except where the producer is *linked*: its consumers read its output itself, so the backward
call of the partition they lead to runs through it too (autograd sums a tensor's gradient over
all its uses in one call). A partition is linked when its gradient can only arrive in one such
call: its output is not the loss, every consumer that takes its gradient runs on this rank and
reads the output as one whole input, and all those consumers lead to the same *root* (an
unlinked partition; a linked one leads to its consumers' root). A root's backward step calls
autograd once for itself and everything linked into it; a linked partition's backward step only
sends its remote inputs' gradients, which that call filled. Its root consumes it on the same
rank and micro-batch, and a rank's backward steps run in reverse topological order, so the
root's step always comes first. A partition with a collective in its backward (a reduction
group of more than one device) is linked only when running that collective inside the root's
call leaves this rank's sequence of sends, receives and collectives as ``device_order`` gives
it (``RankLowering.quiet``), which is what keeps the ranks from waiting on each other. Data
parallel thus runs one backward call per rank.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from soapsearch.executor.rank_lowering import RankLowering
from strategies.graph import OpNode
from strategies.lowering import WEIGHT_KINDS, BucketKey, Gate, Lowered, Partition, loss_on_every_device
from strategies.drops import drop_points
from strategies.rules import get_rule
from strategies.region import Box, box_shape, index_in, slice_box
from strategies.schedule import Step, device_order

__all__ = ["Piece", "Slot", "Send", "LossSum", "Recipe", "Receive", "recipes", "receives_ahead", "SKIP",
           "LINKED", "ROOT"]

Index = "tuple[slice, ...] | None"  # None: the whole tensor
SKIP, LINKED, ROOT = "skip", "linked", "root"


class Piece(NamedTuple):
    """One transfer's part of a buffer: received from rank ``peer`` (tag: the ``transfer``'s
    index), or local (``peer`` None) from task ``task``'s tensor (its input ``slot`` leaf for a
    gradient) at ``src``. It fills ``into`` of the buffer (None: all of it)."""

    transfer: int
    peer: int | None
    task: int | None
    slot: int
    src: Index
    into: Index
    shape: tuple[int, ...]
    what: str


class Slot(NamedTuple):
    """How an input of a partition is read: a view ``index`` of local ``weight``, or the
    ``pieces`` of a producer's output (``shape``, ``dtype``); ``leaf`` cuts the graph there with a
    leaf copy, ``link`` keeps it (the producer is linked); neither: no gradient, detached.
    ``partial``: the pieces are Partial sums (``Transfer.partial``), added in piece order."""

    weight: str | None
    index: Index
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    leaf: bool
    link: bool
    partial: bool = False
    collective: int | None = None
    """Read from this collective (its index in ``Lowered.collectives``): what it leaves this
    rank, which the rank's call of it at an earlier step (or this one) stored."""


class Send(NamedTuple):
    """Send ``src`` of the output (``slot`` None) or of input ``slot``'s leaf gradient (zeros
    of ``shape``, ``dtype`` when it got none) to rank ``peer``, tagged by the ``transfer``."""

    transfer: int
    peer: int
    src: Index
    slot: int | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


class LossSum(NamedTuple):
    """How a partition of the loss op that is the graph's output is scaled
    (``step_loss.StepLoss``): it outputs s_p / ``count`` (the static C_j of its micro-batch,
    ``Loss.static_count``) or s_p (``count`` None: C = Σ c_p, known once its group's sum is);
    ``gates`` says what waits for that sum (``strategies.lowering.gates``: ``Gate.STEP`` or
    ``Gate.BACKWARD``; None: the partition is alone, its own c_p is C)."""

    count: float | None
    gates: Gate | None
    bucket: BucketKey | None = None
    """The gradient bucket its STEP sum rides (``strategies.lowering.bucket_sums``: appended to
    that bucket's flat all-reduce, no collective of its own); None: the sum has its own
    collective (or none: alone)."""


class Recipe(NamedTuple):
    """One partition of this rank: task ``id`` (its index in ``recipes``' list)."""

    id: int
    part: Partition
    node: OpNode
    forward_name: str
    backward_name: str
    box: tuple[slice, ...]
    slots: tuple[Slot | None, ...]
    weights: tuple[tuple[str, str, Index], ...]
    """(role, local weight name, view index)."""
    group: tuple[int, ...] | None
    """The devices (sorted) of its reduction group when more than one: its collectives."""
    classes: tuple[int, ...] | None
    """The devices (sorted) of its class shards (a loss cut on ``classes``: their max and sum,
    ``CLASS_SUMS``, in its forward; none in backward), or None."""
    sends: tuple[Send, ...]
    loss: bool
    """This rank counts its micro-batch's loss in the step's loss (``strategies.lowering.loss_on_every_device``; otherwise partition 0's rank counts it and an all-reduce tells the others)."""
    backward: str
    """SKIP (no gradient), LINKED (its root's call covers it) or ROOT (one autograd call)."""
    seed: float | None
    """The output gradient of a partition of the graph's output, 1/m (m micro-batches), before
    a loss's dynamic divisor (see ``step_loss.StepLoss``)."""
    loss_sum: LossSum | None
    """Set on the partitions of a loss op that is the graph's output."""
    grad_pieces: tuple[Piece, ...]
    grad_whole: bool
    """Every gradient piece covers the whole output: sum them, no buffer."""
    grad_sends: tuple[Send, ...]
    grad_collectives: tuple[tuple[int, Index], ...] = ()
    """(collective, into): the collectives this partition holds whose dual moves its output's
    gradient back; the dual's result fills ``into`` of the output gradient (None: all of it)."""
    calls: tuple[int, ...] = ()
    """The collectives this rank calls at the start of this partition's forward step, in order
    (``strategies.schedule.collective_calls``)."""
    grad_calls: tuple[int, ...] = ()
    """The duals it calls at the start of this partition's backward step, in order."""
    recompute: bool = False
    """Its op recomputes (docs/design.md, "Recompute"): the forward runs without autograd and
    keeps only ``keeps``' inputs; the partition is recomputed with autograd at the backward
    step of a recipe that lists it in ``regraphs``."""
    keeps: tuple[bool, ...] = ()
    """Recompute, per input: the input holds a piece received from another rank, kept (as
    gathered) for the recomputation; the other inputs are read again where they are kept."""
    frees: tuple[int, ...] = ()
    """The recipes whose dropped or transient outputs (``strategies.drops.drop_points``) this
    rank lets go of after this forward step (a transient one's storage: its autograd graph
    stays for its backward, which reads none of it)."""
    regraphs: tuple[int, ...] = ()
    """The recompute recipes recomputed (with autograd, in forward order) at the start of this
    backward step: dropped outputs where ``drop_points`` says, the others at their own."""


def recipes(low: Lowered, order: Sequence[Step], rank: int,
            weight_index: Callable[[str, Box], Index], order_all: dict[int, list[Step]] | None = None) -> list[Recipe]:
    """The recipe of every partition in ``order`` (this rank's steps), in forward order;
    ``weight_index(name, region)`` is the view of a local weight that ``region`` is;
    ``order_all``: every device's ``device_order`` (computed when not given)."""
    lw = RankLowering(low, order, rank, device_order(low) if order_all is None else order_all)
    graph, m, every_rank = low.graph, low.strategy.microbatches, loss_on_every_device(low)
    linked = lw.linked()
    out = []
    for k in lw.keys:
        p, node = lw.parts[k], graph[k[0]]
        kind = SKIP if not lw.has_backward(k) else LINKED if k in linked else ROOT
        seed = 1.0 / m if kind == ROOT and p.op in graph.outputs else None
        grad_pieces = _grad_pieces(lw, p) if kind == ROOT and seed is None else ()
        grad_collectives = _grad_collectives(lw, p) if kind == ROOT and seed is None else ()
        grad_sends = tuple(
            Send(i, t.src_device, index_in(t.region, p.input_regions[t.slot]), t.slot,
                 box_shape(p.input_regions[t.slot]), getattr(torch, graph[t.src_op].output.dtype))
            for i, t in lw.into.get(k, ()) if not t.local and lw.carries(t)) if kind != SKIP else ()
        out.append(Recipe(
            lw.ids[k], p, node, f"F {p.op}[{p.index}] mb{p.microbatch}", f"B {p.op}[{p.index}] mb{p.microbatch}",
            slice_box(p.box), _slots(lw, p, linked, weight_index),
            tuple((role, node.weight(role).name, weight_index(node.weight(role).name, region))
                  for role, region in p.weight_regions) if node.kind not in WEIGHT_KINDS else (),  # read by consumers
            lw.grouped.get(k), lw.classes.get(k),
            tuple(Send(i, t.dst_device, index_in(t.region, p.output)) for i, t in lw.out_of.get(k, ()) if not t.local),
            p.op in graph.outputs and (every_rank or p.index == 0), kind, seed, _loss_sum(lw, k),
            grad_pieces, bool(grad_pieces or grad_collectives) and all(
                g.into is None for g in grad_pieces) and all(into is None for _, into in grad_collectives),
            grad_sends, grad_collectives, tuple(lw.calls.get(Step(False, *k[:2], k[2]), ())),
            tuple(lw.calls.get(Step(True, *k[:2], k[2]), ()))))
    return _recomputes(lw, out, rank)


def _recomputes(lw: RankLowering, out: list[Recipe], rank: int) -> list[Recipe]:
    """``out`` with the recompute fields set (``Recipe.recompute``, ``keeps``, ``frees``,
    ``regraphs``): where this rank drops and recomputes, as ``strategies.drops.drop_points``
    says (``simulator.memory`` walks the same points)."""
    strategy = lw.low.strategy
    points = drop_points(lw.graph, strategy)
    if not points:
        return out
    frees: dict[int, list[int]] = {}
    regraphs: dict[int, list[int]] = {}
    mine: dict[tuple[str, int], list[int]] = {}  # (op, micro-batch) -> this rank's recipes of it, in partition order
    for k in lw.keys:
        mine.setdefault((k[0], k[2]), []).append(lw.ids[k])
    for r in out:
        at = points.get((r.part.op, rank))
        j = r.part.microbatch
        if not strategy[r.part.op].recompute:  # a transient output (never recomputed): freed only
            if at is not None:
                frees.setdefault(mine[(at.free_after, j)][-1], []).append(r.id)
            continue
        if at is None:  # kept: recomputed at its own backward step
            regraphs.setdefault(r.id, []).append(r.id)
            continue
        frees.setdefault(mine[(at.free_after, j)][-1], []).append(r.id)  # after its last forward step there
        regraphs.setdefault(mine[(at.recompute_at, j)][-1], []).append(r.id)  # the first backward step there
    done = []
    for r in out:
        keeps = tuple(s is not None and s.weight is None and any(p.peer is not None for p in s.pieces)
                      for s in r.slots) if strategy[r.part.op].recompute else ()
        done.append(r._replace(recompute=strategy[r.part.op].recompute, keeps=keeps,
                               frees=tuple(frees.get(r.id, ())), regraphs=tuple(sorted(regraphs.get(r.id, ())))))
    return done


def _grad_collectives(lw: RankLowering, p: Partition) -> tuple[tuple[int, Index], ...]:
    """The duals whose result is part of holder ``p``'s output gradient, with where it goes:
    an all-gather's dual leaves member i its chunk, the others the whole region."""
    out = []
    for i in lw.holding.get((p.op, p.index, p.microbatch), ()):
        c = lw.low.collectives[i]
        if c.grad:
            region = c.chunk(c.devices.index(p.device)) if c.kind == "all_gather" else c.region
            out.append((i, index_in(region, p.output)))
    return tuple(out)


def _loss_sum(lw: RankLowering, k: tuple) -> LossSum | None:
    """The LossSum of partition ``k`` when its op is a loss and the graph's output, else None."""
    node = lw.graph[k[0]]
    if node.kind != "loss" or node.name not in lw.graph.outputs:
        return None
    count = get_rule("loss").static_count(node, lw.low.strategy.microbatches)
    return LossSum(count, lw.gates.get(k), lw.rides.get(k))


def _where(p: Partition) -> str:
    return f"op {p.op!r} partition {p.index} (micro-batch {p.microbatch})"


def _slots(lw: RankLowering, p: Partition, linked: set[tuple],
           weight_index: Callable[[str, Box], Index]) -> tuple[Slot | None, ...]:
    """How ``p`` reads each of its inputs."""
    node = lw.graph[p.op]
    slots: list[Slot | None] = []
    for slot, region in enumerate(p.input_regions):
        src = lw.graph[node.inputs[slot]]
        if region is None:
            slots.append(None)
            continue
        if src.kind in WEIGHT_KINDS:
            name = src.weights[0].name
            slots.append(Slot(name, weight_index(name, region), (), box_shape(region), None, False, False))
            continue
        carry = lw.grad[src.name] and lw.grad[p.op]
        shared = lw.shared.get((p.op, p.index, p.microbatch, slot))
        if shared is not None:
            slots.append(Slot(None, None, (), box_shape(region), getattr(torch, src.output.dtype), carry, False,
                              collective=shared))
            continue
        pieces = []
        for i, t in lw.into.get((p.op, p.index, p.microbatch), ()):
            if t.slot == slot:
                skey = (src.name, t.src_index, t.microbatch)
                pieces.append(Piece(
                    i, None if t.local else t.src_device, lw.ids[skey] if t.local else None, slot,
                    index_in(t.region, lw.parts[skey].output) if t.local else None, index_in(t.region, region),
                    box_shape(t.region),
                    f"output of op {src.name!r} partition {t.src_index} (micro-batch {p.microbatch}) "
                    f"for {_where(p)}"))
        link = carry and len(pieces) == 1 and pieces[0].peer is None and lw.keys[pieces[0].task] in linked
        slots.append(Slot(None, None, tuple(pieces), box_shape(region), getattr(torch, src.output.dtype),
                          carry and not link, link, any(t.partial for _, t in lw.into.get((p.op, p.index, p.microbatch), ())
                                                        if t.slot == slot)))
    return tuple(slots)


def _grad_pieces(lw: RankLowering, p: Partition) -> tuple[Piece, ...]:
    """Where a root's output gradient comes from: each consumer's leaf on this rank, or a
    piece received from its rank."""
    out = []
    for i, t in lw.out_of.get((p.op, p.index, p.microbatch), ()):
        if not lw.carries(t):
            continue
        dst = (t.dst_op, t.dst_index, t.microbatch)
        out.append(Piece(
            i, None if t.local else t.dst_device, lw.ids[dst] if t.local else None, t.slot,
            index_in(t.region, lw.parts[dst].input_regions[t.slot]) if t.local else None,
            index_in(t.region, p.output), box_shape(t.region),
            f"gradient for {_where(p)} from op {t.dst_op!r} partition {t.dst_index}"))
    return tuple(out)


class Receive(NamedTuple):
    """A piece this rank receives in a step: from rank ``peer``, tagged by ``transfer`` and
    direction, into a buffer of ``shape`` and ``dtype``."""

    peer: int
    transfer: int
    backward: bool
    shape: tuple[int, ...]
    dtype: torch.dtype


def receives_ahead(steps: Sequence[tuple[bool, Recipe]]) -> list[tuple[Receive, ...]]:
    """Per step of this rank's order, the receives to post (``P2P.post``) before running it:
    at its first forward step of micro-batch j, every forward piece of micro-batches j and
    j + 1; at its first backward step of j, every gradient piece of j and j + 1. A piece whose
    receive is posted before its sender sends moves as soon as it is sent (gloo pairs a send
    with a posted receive at once; otherwise the receiver's late receive asks the sender for
    the data, a round trip that waits on the sender's process getting a core). One micro-batch
    ahead keeps a pipeline stage's next input moving while it computes the current one;
    ``simulator.memory`` counts the buffers."""
    pieces: dict[tuple[bool, int], list[Receive]] = {}
    for r in {r.id: r for _, r in steps}.values():
        j = r.part.microbatch
        for s in r.slots:
            if s is not None and s.weight is None:
                pieces.setdefault((False, j), []).extend(
                    Receive(p.peer, p.transfer, False, p.shape, s.dtype) for p in s.pieces if p.peer is not None)
        dtype = getattr(torch, r.node.output.dtype)
        pieces.setdefault((True, j), []).extend(
            Receive(p.peer, p.transfer, True, p.shape, dtype) for p in r.grad_pieces if p.peer is not None)
    posted: set[tuple[bool, int]] = set()
    out = []
    for backward, r in steps:
        ahead = []
        for j in (r.part.microbatch, r.part.microbatch + 1):
            if (backward, j) not in posted:
                posted.add((backward, j))
                ahead.extend(pieces.get((backward, j), ()))
        out.append(tuple(ahead))
    return out
