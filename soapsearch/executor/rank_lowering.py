"""This rank's view of the lowering, indexed for building its recipes (``recipe.recipes``), and
which of its partitions are linked into their consumers' autograd call (``recipe``'s module
docstring)."""

from __future__ import annotations

from typing import Sequence

from strategies.lowering import WEIGHT_KINDS, Lowered, Transfer, bucket_sums
from strategies.rules.cross_entropy import CLASS_SUMS
from strategies.schedule import Step, collective_calls
from strategies.zero import gather_uses

__all__ = ["RankLowering"]


class RankLowering:
    """Indexes of ``low`` by (op, partition, micro-batch) for ``rank``: the transfers into and out
    of each partition (``into``, ``out_of``), its reduction group (``grouped``), the collectives it
    holds a piece of (``holding``), its FSDP gathers (``gathering``) and each step's collective
    calls (``calls``)."""

    def __init__(self, low: Lowered, order: Sequence[Step], rank: int, order_all: dict[int, list[Step]]):
        self.low, self.graph = low, low.graph
        self.grad = low.graph.needs_grad
        self.order = list(order)
        self.position = {(s.op, s.index, s.microbatch): i for i, s in enumerate(order) if s.backward}
        self.keys = [(s.op, s.index, s.microbatch) for s in order if not s.backward]
        self.ids = {k: i for i, k in enumerate(self.keys)}
        self.parts = {k: low.partitions[k[0]][k[2]][k[1]] for k in self.keys}
        self.into: dict[tuple, list[tuple[int, Transfer]]] = {}
        self.out_of: dict[tuple, list[tuple[int, Transfer]]] = {}
        for i, t in enumerate(low.transfers):
            if t.dst_device == rank:
                self.into.setdefault((t.dst_op, t.dst_index, t.microbatch), []).append((i, t))
            if t.src_device == rank:
                self.out_of.setdefault((t.src_op, t.src_index, t.microbatch), []).append((i, t))
        self.grouped = {(r.op, k, r.microbatch): tuple(sorted(r.devices)) for r in low.reductions
                        if len(set(r.devices)) > 1 and r.name not in CLASS_SUMS for k in r.partitions}
        self.classes = {(r.op, k, r.microbatch): tuple(sorted(r.devices)) for r in low.reductions
                        if r.name == CLASS_SUMS[0] for k in r.partitions}
        self.gates = {(r.op, k, r.microbatch): r.gates for r in low.reductions for k in r.partitions}
        self.rides = {(r.op, k, r.microbatch): key for r, key in bucket_sums(low).items()
                      for k in r.partitions}
        index = {c: i for i, c in enumerate(low.collectives)}
        self.shared = {(r.dst_op, r.dst_index, r.collective.microbatch, r.slot): index[r.collective]
                       for p in low.pieces.values() for r in p.collective_reads if r.device == rank}
        """(op, partition, micro-batch, input) of this rank -> the collective it reads it from."""
        self.reading = {k[:3] for k in self.shared}
        """Partitions of this rank reading a collective: never linked, so their inputs' gradients
        appear at their own backward step (``strategies.collective_buffers``)."""
        self.holding: dict[tuple, list[int]] = {}
        """(op, partition, micro-batch) of this rank -> the collectives it holds a piece of."""
        for i, c in enumerate(low.collectives):
            if rank in c.devices:
                q = c.holders[c.devices.index(rank)]
                self.holding.setdefault((c.op, q, c.microbatch), []).append(i)
        self.gathering = {(u.op, k, j) for u in gather_uses(low) for d, k in zip(u.shard.devices, u.partitions)
                          if d == rank for j in range(low.strategy.microbatches)}
        """Partitions reading level-3 weights (FSDP): never linked, so their backward runs at their own
        step, between the gather and the reduce-scatter (``gathered.GatheredWeights``)."""
        self.calls: dict[Step, list[int]] = {}
        """Step of this rank -> the collectives (forward or dual) it calls at its start."""
        for call in collective_calls(low, order_all).get(rank, ()):
            self.calls.setdefault(call.step, []).append(call.collective)

    def carries(self, t: Transfer) -> bool:
        return self.graph.moves_grad(t.src_op, t.dst_op)

    def has_backward(self, k: tuple) -> bool:
        return self.grad[k[0]] and self.graph[k[0]].kind not in (*WEIGHT_KINDS, "input")

    def whole_slot(self, t: Transfer) -> bool:
        """``t`` alone fills its consumer's input slot."""
        dst = (t.dst_op, t.dst_index, t.microbatch)
        pieces = [u for _, u in self.into[dst] if u.slot == t.slot]
        return len(pieces) == 1 and t.region == self.parts[dst].input_regions[t.slot]

    def talks(self, k: tuple) -> bool:
        """The backward step of ``k`` receives or sends a gradient piece."""
        return self.has_backward(k) and any(
            not t.local and self.carries(t) for _, t in [*self.out_of.get(k, ()), *self.into.get(k, ())])

    def quiet(self, r: tuple, k: tuple, root: dict[tuple, tuple]) -> bool:
        """Moving grouped ``k``'s backward collective into root ``r``'s backward call keeps this
        rank's sequence of communications: ``r`` sends nothing after its call, and every step
        between theirs is a backward step that neither sends nor receives, whose own collective
        (if any) moves into that call too, in the same order (autograd runs a graph's nodes in
        reverse order of creation: the forward order)."""
        if any(not t.local and self.carries(t) for _, t in self.into.get(r, ())):
            return False
        for s in self.order[self.position[r] + 1:self.position[k] + 1]:
            between = (s.op, s.index, s.microbatch)
            if s in self.calls:  # a collective's dual called there would come after the moved one
                return False
            if s == self.order[self.position[k]]:
                continue
            if not s.backward or self.talks(between) or (between in self.grouped and root[between] != r):
                return False
        return True

    def linked(self) -> set[tuple]:
        """The linked partitions (``recipe``'s module docstring), deciding consumers before producers."""
        root: dict[tuple, tuple] = {}
        redo = self.low.strategy.__getitem__
        for k in reversed(self.keys):
            gout = [t for _, t in self.out_of.get(k, ()) if self.carries(t)]
            leads = {root[(t.dst_op, t.dst_index, t.microbatch)] for t in gout if t.local}
            root[k] = k
            if redo(k[0]).recompute or any(redo(t.dst_op).recompute for t in gout):
                continue  # a recomputed partition has its own autograd graph, read through leaves
            if (self.has_backward(k) and k[0] not in self.graph.outputs and gout and k not in self.holding
                    and k not in self.gathering and k not in self.reading
                    and all(t.local and self.whole_slot(t) for t in gout) and len(leads) == 1):
                lead = leads.pop()
                if k not in self.grouped or self.quiet(lead, k, root):
                    root[k] = lead
        return {k for k, r in root.items() if r != k}
