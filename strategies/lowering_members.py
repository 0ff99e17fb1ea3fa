"""The lowering of member representatives (``strategies.lowering.lower(copies=MemberFold)``):
members 0 and 1 of copy 0's tensor-parallel groups stand for every member (docs/design.md,
"Member folding").

A plan whose copy 0 (``strategies.symmetry``; the whole plan where it has one copy) runs groups
of T devices (``strategies.member_symmetry.find_members``: member m of a group on ψ_m of
member 0's device) computes on member m ≥ 2 the shapes member 1 does, on another shard. The
lowering of the representatives holds:

- the partitions of members 0 and 1 of copy 0 (``MemberFold.kept``), the transfers and
  collectives into them (each group collective once, with its whole member list, as any
  collective of a kept partition is), reduction groups holding one of them whole;
- every weight shard with its whole holder list, as the copy-0 lowering has it: member m reads
  another region of each weight than member 1 (the same size), so the weight reads of every
  copy-0 partition are derived (its box and weight regions only: ``member_reads``), and the
  shards, the gradient buckets and the per-device weight bytes follow from them as per device;
- per-device totals of activations and received bytes (``DeviceBytes``' first three) of every
  device: a device of member m ≥ 2 gets its member-1 image's (``MemberFold.rep_array``).

``member_reads`` checks what the fold stands on while it derives the reads: every member m ≥ 2
device holds partitions of the shapes and weight-region shapes its member-1 image holds, and
each of their inputs comes from the partition's own member or from whole groups, as member 1's
do; a transfer between members 0 and 1 is refused where the pieces are made (``lower_op``).
Where a check fails the lowering raises ``CrossCopy`` naming the op: the plan is lowered with
copies alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from strategies.config import ParallelConfig
from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS, WeightRead
from strategies.lowering_copies import kept_indices
from strategies.member_symmetry import TensorMembers, find_members
from strategies.region import box_shape
from strategies.strategy import Strategy
from strategies.symmetry import Copies, CrossCopy

__all__ = ["MemberKeep", "MemberFold", "fold_of", "member_fold", "member_reads", "other_partitions", "other_reads"]

_new = tuple.__new__


class MemberKeep(frozenset):
    """The devices whose partitions a member-folded lowering keeps (members 0 and 1 of copy 0),
    with ``reads``, copy 0's devices, whose partitions' weight reads it derives too, ``member``,
    each copy-0 device's member index, and ``rep``, each one's representative
    (``MemberFold.member_rep``). Equal only to a keep of the same."""

    reads: frozenset
    member: dict
    rep: dict

    def __new__(cls, kept, reads, member, rep):
        self = super().__new__(cls, kept)
        self.reads = frozenset(reads)
        self.member = member
        self.rep = rep
        return self

    def __eq__(self, other) -> bool:
        return (type(other) is MemberKeep and frozenset.__eq__(self, other) and self.reads == other.reads
                and self.member == other.member and self.rep == other.rep)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((frozenset(self), self.reads))

    def __reduce__(self):
        return MemberKeep, (frozenset(self), self.reads, self.member, self.rep)


@dataclass(frozen=True, eq=False)
class MemberFold(Copies):
    """The copies of a plan (``Copies``: one copy of every device where it has none) and the
    tensor-parallel members of copy 0: ``members.members[m][i]`` is member m of copy 0's group i."""

    members: TensorMembers = None

    def __eq__(self, other) -> bool:
        return type(other) is MemberFold and self.copies == other.copies and self.members == other.members

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.copies, self.members.copies))

    @cached_property
    def kept(self) -> MemberKeep:
        """Members 0 and 1 of copy 0: the devices a member-folded lowering lowers."""
        rows = self.members.members
        return MemberKeep(set(rows[0]) | set(rows[1]), self.copies[0],
                          {d: m for m, row in enumerate(rows) for d in row}, self.member_rep)

    @cached_property
    def member_rep(self) -> dict[int, int]:
        """Copy 0's device -> its representative: itself for members 0 and 1, its member-1
        image ψ_1 ψ_m⁻¹ for member m ≥ 2."""
        rows = self.members.members
        return {d: (d if m < 2 else rows[1][i]) for m, row in enumerate(rows) for i, d in enumerate(row)}

    @cached_property
    def representative(self) -> dict[int, int]:
        """Device -> the kept device it is the image of (its copy-0 image's representative)."""
        rep = self.member_rep
        return {d: rep[r] for d, r in super().representative.items()}

    @cached_property
    def stands_for(self) -> dict[int, tuple[int, ...]]:
        """Each kept device -> the devices its work stands for: its copy images, and a member-1
        device its member images' too."""
        out: dict[int, list[int]] = {}
        for d, r in self.representative.items():
            out.setdefault(r, []).append(d)
        return {r: tuple(sorted(ds)) for r, ds in out.items()}

    @cached_property
    def member_rows(self) -> tuple[tuple[int, ...], ...]:
        """Member m's devices in every copy (``members.members[m]``' and their copy images)."""
        images = self.images
        return tuple(tuple(x for d in row for x in images.get(d, (d,))) for row in self.members.members)

    def rep_array(self, n: int) -> np.ndarray:
        """Device -> the kept device it is the image of (its copy-0 image's representative);
        read-only, made once per fold and device count."""
        return _member_rep_array(self, n)

    def __str__(self) -> str:
        return f"{self.count} copies of {self.size} device(s), {self.members}"


@functools.lru_cache(maxsize=64)
def _member_rep_array(fold: "MemberFold", n: int) -> np.ndarray:
    rep = fold.member_rep
    out = np.fromiter((rep.get(d, d) for d in Copies.rep_array(fold, n).tolist()), np.int64, n)
    out.flags.writeable = False
    return out


def member_fold(graph: OpGraph, strategy: Strategy, copies: Copies | None = None) -> MemberFold | str:
    """The member fold of ``strategy`` within copy 0 of ``copies`` (None: one copy of every
    device), or why there is none (one line)."""
    return fold_of(find_members(graph, strategy), strategy.num_devices, copies)


def fold_of(found: TensorMembers | None, n: int, copies: Copies | None = None) -> MemberFold | str:
    """The member fold within copy 0 of ``copies`` (None: one copy of each of ``n`` devices) of a
    plan whose members are ``found`` (``find_members``), or why there is none (one line)."""
    if found is None:
        return "no tensor-parallel members alike on every op (find_members)"
    if found.count < 3:
        return f"{found.count} members: members 0 and 1 are all of them"
    rows = copies.copies if copies is not None else (tuple(range(n)),)
    first = set(rows[0])
    keep = [i for i, d in enumerate(found.members[0]) if d in first]
    if not keep or any(not group <= first for group in (found.groups[i] for i in keep)):
        return "a tensor-parallel group spans copies"
    if sum(len(found.groups[i]) for i in keep) != len(first):
        return "copy 0 holds devices in no tensor-parallel group"
    members = TensorMembers(tuple(tuple(row[i] for i in keep) for row in found.members))
    return MemberFold(rows, members)


def member_reads(node: OpNode, cfg: ParallelConfig, rule, keep: MemberKeep, sources: Sequence[tuple],
                 m: int, reads: list[WeightRead], spans: list[tuple[int, int, int]]) -> list[WeightRead]:
    """The weight reads of every copy-0 partition of ``node`` in partition order: the kept
    partitions' (``reads``, partition k's at ``spans``' (k, start, end)) and the others' derived
    from their boxes; ``CrossCopy`` where a member m ≥ 2 device's partitions are not its
    member-1 image's (module docstring)."""
    from strategies.pieces import box_at, grid_of, overlapping  # pieces imports this module

    grid = grid_of(node, cfg.degrees, 0, m)
    grids = [grid_of(p, c.degrees, 0, m) for p, c in sources]
    member = keep.member
    whole = set(member.values())
    mine = {k: reads[a:b] for k, a, b in spans}
    signs: dict[int, list] = {}
    out: list[WeightRead] = []
    for k in kept_indices(cfg, keep.reads):
        dev = cfg.devices[k]
        at = member[dev]
        box = box_at(grid, cfg.degrees, k)
        ins = rule.input_regions(node, box)
        ws = rule.weight_regions(node, box)
        got = mine.get(k)
        if got is None:
            got = [_new(WeightRead, (w.name, ws[w.role], dev, node.name, w.spec.dtype, w.trainable, cfg.zero))
                   for w in node.weights if w.role in ws]
            for slot, region in enumerate(ins):
                producer, pcfg = sources[slot]
                if region is not None and producer.kind in WEIGHT_KINDS:
                    w = producer.weights[0]
                    got.append(_new(WeightRead, (w.name, region, dev, node.name, w.spec.dtype, w.trainable,
                                                 max(cfg.zero, pcfg.zero))))
        out.extend(got)
        if at == 0:
            continue
        froms = []
        for slot, region in enumerate(ins):
            producer, pcfg = sources[slot]
            if region is None or producer.kind in WEIGHT_KINDS:
                continue
            extra = tuple((0, producer.shape[i]) for i in producer.reduction_dims) if producer.kind != "loss" else ()
            held = {member.get(pcfg.devices[q], -1) for q, _, _ in overlapping(grids[slot], pcfg.degrees,
                                                                               region + extra)}
            froms.append("own" if held == {at} else "all" if held == whole else tuple(sorted(held)))
        signs.setdefault(dev, []).append((box_shape(box), tuple(sorted((r, box_shape(b)) for r, b in ws.items())),
                                          tuple(froms)))
    for dev, sign in signs.items():
        base = keep.rep[dev]
        if base != dev and sign != signs.get(base, []):  # in partition order: the run order alike
            raise CrossCopy(f"op {node.name!r}: device {dev} (member {member[dev]}) computes other shapes or reads "
                            f"other members than its member-1 image, device {base}; member folding needs members "
                            "1..T-1 alike", node.name)
    return out


def other_partitions(node: OpNode, cfg: ParallelConfig, rule, keep: MemberKeep, grid: tuple
                     ) -> tuple[tuple[int, int, tuple], ...]:
    """(index, device, input regions) of ``node``'s copy-0 partitions a member fold does not
    keep, on ``grid`` (one micro-batch's): their reads make the group collectives whole."""
    from strategies.pieces import box_at  # pieces imports this module

    return tuple((k, cfg.devices[k], tuple(rule.input_regions(node, box_at(grid, cfg.degrees, k))))
                 for k in kept_indices(cfg, keep.reads) if cfg.devices[k] not in keep)


def other_reads(others: Sequence[tuple[int, int, tuple]], slot: int, grid: tuple, degrees: tuple,
                extra: tuple) -> list[tuple[int, int, tuple, tuple[int, ...]]]:
    """``find_collectives``' reads of input ``slot`` by the partitions ``others``
    (``other_partitions``): (index, device, region, the producer partitions it overlaps)."""
    from strategies.pieces import overlapping  # pieces imports this module

    return [(k, dev, ins[slot], tuple(q for q, _, _ in overlapping(grid, degrees,
                                                                  ins[slot] + extra)))
            for k, dev, ins in others if ins[slot] is not None]
