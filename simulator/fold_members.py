"""Member-folded simulation: members 0 and 1 of copy 0's tensor-parallel groups simulated for
every member (docs/design.md, "Member folding"; the lowering: ``strategies.lowering_members``).

``build_tasks`` on a member fold's lowering builds the tasks of the kept devices (members 0 and
1 of copy 0) and each group collective once, timed over its whole group on its whole ring. Its
timeline is every member's, member m ≥ 2's being member 1's moved by φ_m (device ψ_m ψ_1⁻¹),
on the conditions of the copy fold (``simulator.fold``) read along the members:

- members 1..T-1 own the links of their routes among their own devices in every copy (stage
  boundaries, member m's data-parallel gradient sync), and φ_m maps member 1's routes link by
  link onto member m's (``link_maps`` of the member rows); member 0's routes cross none of them;
- a task shared by members (a group collective) holds every image of a member-1 link it holds,
  or runs after the members' own traffic on it (``Folded.holds``);
- no device slows another (``simulator.contention``; ``simulate_plan`` folds only then), and
  no step-end collective with an overhead (``simulator.stragglers``) waits on both member 0 and
  another member (each simulated host stands for the same count there).

A task then stands for (its copies) × (its members) tasks of the full simulation: a member-1
task that holds only member 1's links for T - 1, any other for 1 (``MemberFolded.copies``).
Where a condition fails ``FoldError`` names it and the plan is simulated on its copies alone.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from simulator.fold import Folded, FoldError, LinkMaps, link_maps, task_copies, unkept_route
from simulator.taskgraph import TaskGraph
from simulator.topology import Topology
from strategies.lowering_members import MemberFold
from strategies.symmetry import Copies

__all__ = ["MemberFolded", "member_maps", "fold_members"]


class MemberFolded(NamedTuple):
    """What a member-folded task graph needs besides its tasks (``fold_members``)."""

    copies: np.ndarray
    """How many tasks of the full simulation each task stands for (copies × members)."""
    parts: tuple[Folded, ...]
    """The copy fold's ``Folded`` (where the plan has copies) and the members'."""

    def holds(self, start: np.ndarray, end: np.ndarray) -> bool:
        """Whether the timeline is every copy's and every member's (``Folded.holds`` of each)."""
        return all(p.holds(start, end) for p in self.parts)

    def coarser(self) -> None:
        """No fewer members are tried: ``simulate_plan`` simulates the copies alone instead."""
        return None


@functools.lru_cache(maxsize=32)
def member_maps(topology: Topology, fold: MemberFold) -> LinkMaps | str:
    """φ_m on links (``LinkMaps``; owner 0 is member 1) of members 1..T-1 over every copy, or
    why there is none (one line)."""
    rows = fold.member_rows
    maps = link_maps(topology, Copies(rows[1:]))
    if maps is None:
        return (f"members 1..{len(rows) - 1} do not own their links on {topology.name!r} (a route shared "
                "between members, or not mapped link by link)")
    route, owner = unkept_route(topology), maps.owner
    zero = rows[0]
    for a in zero:
        for b in zero:
            if a != b and any(owner[l] >= 0 for l in route(a, b)):
                return f"member 0's route {a} -> {b} crosses a link of members 1..{len(rows) - 1}"
    return maps


def fold_members(tg: TaskGraph, topology: Topology, fold: MemberFold, copy_maps: LinkMaps | None) -> MemberFolded:
    """``MemberFolded`` of ``tg``, built on ``fold``'s lowering; ``copy_maps``: the copies' link
    maps (None: one copy). ``FoldError`` where the members do not own their links."""
    maps = member_maps(topology, fold)
    if isinstance(maps, str):
        raise FoldError(maps)
    member = fold.kept.member
    for c, hosts, _, _ in tg.syncs:  # simulator.stragglers weighs each simulated host alike
        if len({member.get(d, -1) == 0 for d, _ in hosts}) > 1:
            raise FoldError(f"step-end collective {tg.label(c)!r} waits on member 0 and another member, which "
                            "stand for different member counts: its straggler scaling (simulator.stragglers) is per device")
    count = fold.members.count - 1
    by_member = task_copies(tg, maps, count)
    ones = np.zeros(tg.num_devices, dtype=bool)
    ones[list(fold.member_rows[1])] = True
    on_one = ones[np.asarray(tg.device, dtype=np.int64)]
    members = np.where((by_member.copies > 1) & on_one, count, 1)
    if copy_maps is None:
        return MemberFolded(members, (by_member,))
    by_copy = task_copies(tg, copy_maps)
    return MemberFolded(by_copy.copies * members, (by_copy, by_member))
