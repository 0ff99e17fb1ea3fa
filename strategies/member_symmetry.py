"""Member folding's classes: the members of tensor-parallel groups that run the same shapes,
found from the Strategy (the design: docs/design.md, "Member folding").

Within one data-parallel copy (``strategies.symmetry``) and one pipeline stage, a Megatron-LM
layer runs on a group of T devices that cut its non-sample dims (heads, hidden features, the
sequence under sequence parallelism); member m of every group computes the same shapes as
member 0 on another shard. A plan has a T-member fold when, for every non-weight op and every
sample coordinate c, the partitions at c (other coordinates in mixed-radix order, last dim
fastest) are T in number, cut evenly, and the one at position m runs on ψ_m of the device of the
one at position 0, with one ψ_m: M_0 -> M_m for all ops and disjoint sets M_0..M_{T-1}; an op
of fewer partitions at each c is cut evenly on devices closed under every ψ_m
(``find_members``). The lowering's pieces must then keep the members apart as well
(``members_apart``): a transfer between two devices keeps its member index, and a collective
either spans whole groups (one task, the same under every ψ_m) or lies in one member set with its
image in every other. Where either fails the plan is simulated as today. Both checks and the
classes (``member_classes``) are decided per op (``strategies.member_pieces``); the per-record
reference is ``strategies.member_reference``.
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, NamedTuple

import numpy as np

from strategies.config import ParallelConfig
from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS
from strategies.member_pieces import held_extents, ops_crossing_members, ops_splitting_groups, origins
from strategies.member_reference import collectives_apart, transfers_apart
from strategies.strategy import Strategy
from strategies.symmetry import Copies

if TYPE_CHECKING:
    from strategies.lowered import Lowered

__all__ = ["OpCut", "TensorMembers", "find_members", "member_classes", "members_apart", "members_of", "op_cut"]


class TensorMembers(Copies):
    """T member sets of G devices: ``members[m][i]`` is ψ_m(``members[0][i]``), the device at
    position m of the group whose position 0 is ``members[0][i]``. The structure of ``Copies``
    (its count T, size G, representative and images serve as they are), read along the
    tensor-parallel groups instead of the sample dim."""

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """The member sets M_0..M_{T-1}, each in member 0's group order."""
        return self.copies

    @cached_property
    def index(self) -> dict[int, tuple[int, int]]:
        """Device -> (its member index m, its group i)."""
        return {d: (m, i) for m, row in enumerate(self.members) for i, d in enumerate(row)}

    @cached_property
    def groups(self) -> tuple[frozenset[int], ...]:
        """Each group's devices, by group i."""
        return tuple(frozenset(row[i] for row in self.members) for i in range(self.size))

    def image(self, devices: tuple[int, ...], m: int) -> tuple[int, ...]:
        """ψ_m ∘ ψ_(member of devices)⁻¹ of devices that lie in one member set."""
        return tuple(self.members[m][self.index[d][1]] for d in devices)

    def __str__(self) -> str:
        return f"{self.count} members of {self.size} group(s)"


def find_members(graph: OpGraph, strategy: Strategy) -> TensorMembers | None:
    """The member fold of ``strategy`` (module docstring), or None where some op runs another
    member count, cuts a member dim unevenly, places its positions otherwise than the ops before
    it, or the member sets overlap; a plan whose groups are single devices (T = 1) has none. T
    is the largest group an op has. An op of smaller groups (cut on its sample dim alone, as the
    loss's flattened tokens over a stage's devices: groups of one; the targets cut on g·d
    samples × t/g of the sequence: groups of t/g) is alike where every dim is cut evenly and its
    devices are closed under every ψ_m. ``op_cut`` of every non-weight op, then ``members_of``
    their distinct cuts."""
    cuts: dict[tuple, OpCut] = {}
    for node in graph:
        if node.kind in WEIGHT_KINDS:
            continue
        cut = op_cut(node, strategy[node.name])
        if cut is None:
            return None
        cuts.setdefault(cut.key, cut)  # a config cut alike: its groups are checked once
    return members_of(cuts.values())


class OpCut(NamedTuple):
    """What ``find_members`` reads of one op under its config: its groups (``_groups``: one per
    sample coordinate), its dims' sizes and its config (``members_of`` checks an op of groups
    smaller than the members' count against the members found)."""

    groups: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    config: ParallelConfig

    @property
    def key(self) -> tuple:
        """Equal for two ops whose cuts ``members_of`` reads alike (the groups object, shared by
        equal configs, and the op's sizes)."""
        return id(self.groups), self.sizes


def op_cut(node: OpNode, config: ParallelConfig) -> OpCut | None:
    """``node``'s cut under ``config`` (``OpCut``), or None where it has no sample dim or cuts a
    member dim unevenly (no member fold)."""
    groups = _op_groups(node, config)
    return None if groups is None else OpCut(groups, tuple(dim.size for dim in node.dims), config)


def members_of(cuts: Iterable[OpCut]) -> TensorMembers | None:
    """The member fold of a plan whose non-weight ops' distinct cuts are ``cuts`` (``op_cut``;
    any order, repeats allowed), or None (``find_members``)."""
    images: dict[int, tuple[int, ...]] = {}  # ψ: member-0 device -> (d, ψ_1(d), ...)
    cuts = list(cuts)
    count = max((len(cut.groups[0]) for cut in cuts), default=0)
    if count < 2:
        return None
    smaller: list[OpCut] = []
    for cut in cuts:
        if len(cut.groups[0]) < count:
            smaller.append(cut)
            continue
        for group in cut.groups:
            if len(group) != count or images.setdefault(group[0], group) != group:
                return None
    every = [d for group in images.values() for d in group]
    if len(set(every)) != len(every):  # a device at two positions, or in two groups
        return None
    found = TensorMembers(tuple(tuple(images[d][m] for d in sorted(images)) for m in range(count)))
    index = found.index
    for cut in smaller:
        config = cut.config
        placed = set(config.devices)
        if any(size % k for size, k in zip(cut.sizes, config.degrees)):
            return None
        if not all(d in index and {row[index[d][1]] for row in found.members} <= placed for d in placed):
            return None
    return found


def _op_groups(node: OpNode, config: ParallelConfig) -> tuple[tuple[int, ...], ...] | None:
    """The groups of ``config`` on ``node`` (one per sample coordinate: its partitions' devices,
    in mixed-radix order over the other dims), or None where the op has no sample dim or cuts
    a member dim unevenly (members would compute different shapes)."""
    i = node.sample_dim
    if i is None:
        return None
    for j, (dim, k) in enumerate(zip(node.dims, config.degrees)):
        if j != i and dim.size % k:
            return None
    return _groups(config, i)


@functools.lru_cache(maxsize=4096)  # a config's devices: up to thousands of ints per entry
def _groups(config: ParallelConfig, sample: int) -> tuple[tuple[int, ...], ...]:
    grid = np.asarray(config.devices, dtype=np.int64).reshape(config.degrees)
    rows = np.moveaxis(grid, sample, 0).reshape(config.degrees[sample], -1)
    return tuple(map(tuple, rows.tolist()))


def members_apart(lowered: Lowered, members: TensorMembers) -> str | None:
    """Why ``lowered``'s pieces break ``members``' symmetry (one line naming the piece), or None
    where they keep it: every transfer between two devices keeps its member index, and every
    collective spans whole groups or lies in one member set with its image under every ψ_m
    among the collectives of its op and micro-batch.

    Decided per op, not per record (``strategies.member_pieces``): an op's transfers keep the
    members where every (source, destination) device pair among them does, and its
    collectives where each device set among them spans whole groups; both are read once per
    pieces object and moved by each op's δ (``origins``), and judged once per (pieces, δ). The
    first op that fails has its records read one at a time to name the piece
    (``strategies.member_reference``: the same line as the per-record check); where a
    collective lies in one member set its images are looked for among all the plan's."""
    origin = origins(lowered)
    for op in ops_crossing_members(lowered, members, origin):
        why = transfers_apart(lowered.pieces[op].transfers, members.index)
        if why is not None:
            return why
    if next(ops_splitting_groups(lowered, members, origin), None) is not None:
        # one member's set (or one across members): judged against the plan's others
        return collectives_apart((r.collective for p in lowered.pieces.values() for r in p.collective_reads), members)
    return None


def member_classes(lowered: Lowered, members: TensorMembers) -> tuple[tuple[int, ...], ...]:
    """The member indices split into classes of alike members: m and m' are alike where, in
    every group, their devices hold partitions of the same ops, micro-batches, extents and
    weight-region extents (a row-parallel linear's bias is read only where its in_features
    range starts at 0, so member 0 of such a plan is a class of its own, and so is a weight op
    placed on one member). Classes in order of their first member.

    Decided per op: each pieces object's partitions are summarised once per device
    (``member_pieces.held_extents``), and the ops that share one pieces object and δ
    (``origins``) give every member the same row of those per group; members are alike where
    all their rows are (the per-record ``member_reference.member_classes_reference`` sorts
    every partition into its device's list instead)."""
    origin = origins(lowered)
    rows: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
    for op, parts in lowered.partitions.items():
        pieces = lowered.pieces.get(op)
        if pieces is not None and pieces.partitions is parts:
            first, delta = origin[op]
            parts = first.partitions
        else:  # partitions apart from the op's pieces: read as they are
            delta = 0
        key = (id(parts), delta)
        if key not in rows:
            held = held_extents(parts)
            rows[key] = tuple(tuple(held.get(d - delta, -1) for d in row) for row in members.members)
    classes: dict[tuple, list[int]] = {}
    for m in range(members.count):
        classes.setdefault(tuple(row[m] for row in rows.values()), []).append(m)
    return tuple(tuple(ms) for ms in classes.values())
