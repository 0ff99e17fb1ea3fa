"""The member check read one record at a time (``strategies.member_symmetry`` decides it per
op): every transfer, collective and partition of a lowering looked at on its own. The
reference the per-op check is tested against (tests/simulator/test_member_check.py), and the
part of it that names a piece once the per-op check has found the op that breaks the members'
symmetry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from strategies.region import box_shape

if TYPE_CHECKING:
    from strategies.lowered import Collective, Lowered, Transfer
    from strategies.member_symmetry import TensorMembers

__all__ = ["transfers_apart", "collectives_apart", "members_apart_reference", "member_classes_reference"]


def transfers_apart(transfers: Iterable[Transfer], index: dict[int, tuple[int, int]]) -> str | None:
    """The first of ``transfers`` between two devices that crosses members (``index``: device ->
    (member, group), ``TensorMembers.index``), named in one line; None where none does."""
    for t in transfers:
        if t.src_device == t.dst_device:
            continue
        a, b = index.get(t.src_device), index.get(t.dst_device)
        if a is None or b is None or a[0] != b[0]:
            return (f"transfer {t.src_op}[{t.src_index}] -> {t.dst_op}[{t.dst_index}]: device {t.src_device} -> "
                    f"{t.dst_device} crosses members; a member's transfers must stay among its own devices")
    return None


def collectives_apart(collectives: Iterable[Collective], members: TensorMembers) -> str | None:
    """The first collective (grouped by kind, op, micro-batch and bytes, in the order of their
    first appearance) that neither spans whole groups nor lies in one member set with its image
    under every ψ_m among its group's, named in one line; None where every one keeps
    ``members``. A collective given twice counts once."""
    index = members.index
    kept: dict[tuple, set[tuple[int, ...]]] = {}
    for c in collectives:
        kept.setdefault((c.kind, c.op, c.microbatch, c.nbytes), set()).add(tuple(sorted(c.devices)))
    groups = members.groups
    for (kind, op, mb, _), sets in kept.items():
        for devices in sets:
            at = [index.get(d) for d in devices]
            if any(x is None for x in at):
                return f"{kind} of {op} (micro-batch {mb}): devices {list(devices)} include one in no group"
            if set(devices) == set().union(*(groups[i] for _, i in at)):
                continue  # whole groups: the same set under every ψ_m
            ms = {m for m, _ in at}
            if len(ms) != 1:
                return (f"{kind} of {op} (micro-batch {mb}): devices {list(devices)} mix members of part of "
                        f"their groups; a collective spans whole groups or one member's devices")
            for m in range(members.count):
                if tuple(sorted(members.image(devices, m))) not in sets:
                    return f"{kind} of {op} (micro-batch {mb}): devices {list(devices)} have no image in member {m}"
    return None


def members_apart_reference(lowered: Lowered, members: TensorMembers) -> str | None:
    """``member_symmetry.members_apart`` read record by record: every transfer, then every
    collective."""
    return transfers_apart(lowered.transfers, members.index) or collectives_apart(lowered.collectives, members)


def member_classes_reference(lowered: Lowered, members: TensorMembers) -> tuple[tuple[int, ...], ...]:
    """``member_symmetry.member_classes`` read partition by partition: member m's key is, per
    group, the sorted (op, micro-batch, extents, weight-region extents) of the partitions its
    device holds."""
    index = members.index
    held: list[list[list]] = [[[] for _ in range(members.size)] for _ in range(members.count)]
    for per_mb in lowered.partitions.values():
        for parts in per_mb:
            for p in parts:
                at = index.get(p.device)
                if at is None:
                    continue
                held[at[0]][at[1]].append((p.op, p.microbatch, box_shape(p.box),
                                           tuple((role, box_shape(box)) for role, box in p.weight_regions)))
    keys = [tuple(tuple(sorted(group)) for group in per_member) for per_member in held]
    classes: dict[tuple, list[int]] = {}
    for m, key in enumerate(keys):
        classes.setdefault(key, []).append(m)
    return tuple(tuple(ms) for ms in classes.values())
