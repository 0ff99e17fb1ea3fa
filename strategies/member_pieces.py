"""What the member check reads of one op's pieces, found once per pieces object and shared by
every op whose pieces are that object's renamed and moved (``Lowered.twins``).

``strategies.lowering_shared.renamed`` gives an op another op's pieces with the names swapped
and every device moved by one offset δ, each record otherwise the same: the same transfers
between devices s + δ -> d + δ, the same collectives over D + δ, the same partitions on d + δ
with the same extents. So what the member check reads of them (``member_symmetry``: the device
pairs of remote transfers, the device sets of collectives read, each device's partition
extents) is the first op's moved by δ; GPT-3 175B's 2,123 ops at T = 8, P = 16 have 32 such
first ops (``origins``), and their summaries are kept across calls (a search's proposals share
every unchanged op's pieces) in a bounded cache keyed by the object (held, so its id is not
reused while kept)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Iterator

from strategies.lowered import OpPieces, Partition

if TYPE_CHECKING:
    from strategies.lowered import Lowered
    from strategies.member_symmetry import TensorMembers

__all__ = ["origins", "remote_pairs", "collective_sets", "held_extents", "ops_crossing_members", "ops_splitting_groups"]

_CACHE_SIZE = 256
"""Summaries kept per kind: each holds its pieces object alive (175B's 32 first ops' pieces,
10³–10⁴ records each, are held by the lowering cache anyway; a bound keeps a long search from
holding every proposal's)."""

_caches: dict[str, dict[int, tuple[object, object]]] = {}


def _cached(kind: str, of: Callable[[object], object]) -> Callable[[object], object]:
    """``of`` memoized on the identity of its argument (kept alive beside the result; the
    cache emptied when it holds ``_CACHE_SIZE``)."""
    cache = _caches.setdefault(kind, {})

    def get(obj):
        got = cache.get(id(obj))
        if got is not None and got[0] is obj:
            return got[1]
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        value = of(obj)
        cache[id(obj)] = (obj, value)
        return value

    get.__doc__ = of.__doc__
    return get


def origins(lowered: Lowered) -> dict[str, tuple[OpPieces, int]]:
    """Op -> (pieces P, δ): its pieces are P renamed and every device moved δ on (P its own
    pieces and δ 0 where it has no twin). A twin's first op whose pieces in this lowering are
    themselves a twin's is followed to its own first op (the δs added), so the ops of every
    pipeline stage's layers share one P per layer position."""
    out: dict[str, tuple[OpPieces, int]] = {}
    twins, pieces = lowered.twins, lowered.pieces
    for op in pieces:
        chain: list[tuple[str, int]] = []  # (an op, its δ from the next op on the chain)
        at = op
        while at not in out:
            twin = twins.get(at)
            if twin is None:
                out[at] = (pieces[at], 0)
                break
            first, theirs, delta = twin
            if first == at or any(first == a for a, _ in chain):  # a loop: each op its own
                for a in (at, *(a for a, _ in chain)):
                    out[a] = (pieces[a], 0)
                chain = []
                break
            if pieces.get(first) is not theirs:  # the first op's pieces of another plan: start there
                out[at] = (theirs, delta)
                break
            chain.append((at, delta))
            at = first
        base, shift = out[at]
        for link, delta in reversed(chain):
            shift += delta
            out[link] = (base, shift)
    return out


def _remote_pairs(pieces: OpPieces) -> frozenset[tuple[int, int]]:
    """The (source, destination) devices of ``pieces``' transfers between two devices."""
    return frozenset({(t.src_device, t.dst_device) for t in pieces.transfers if t.src_device != t.dst_device})


def _collective_sets(pieces: OpPieces) -> frozenset[tuple[int, ...]]:
    """The device sets (sorted) of the collectives ``pieces``' partitions read."""
    return frozenset({tuple(sorted(r.collective.devices)) for r in pieces.collective_reads})


def _held_extents(partitions: tuple[tuple[Partition, ...], ...]) -> dict[int, int]:
    """Device -> an id of what its partitions hold (micro-batch, extents, weight-region extents,
    sorted): equal ids for equal holdings among the devices of these partitions."""
    per: dict[int, list] = {}
    shapes: dict[Hashable, tuple] = {}
    for parts in partitions:
        for p in parts:
            ws = p.weight_regions
            w = shapes.get(ws)
            if w is None:
                w = shapes[ws] = tuple((role, tuple([b - a for a, b in box])) for role, box in ws)
            per.setdefault(p.device, []).append((p.microbatch, tuple([b - a for a, b in p.box]), w))
    ids: dict[tuple, int] = {}
    return {d: ids.setdefault(tuple(sorted(held)), len(ids)) for d, held in per.items()}


remote_pairs = _cached("pairs", _remote_pairs)
collective_sets = _cached("collectives", _collective_sets)
held_extents = _cached("held", _held_extents)


def ops_crossing_members(lowered: Lowered, members: TensorMembers,
                         origin: dict[str, tuple[OpPieces, int]] | None = None) -> Iterator[str]:
    """The ops, in graph order, some of whose transfers between two devices cross members (a
    device in no group, or two member indices): each op's ``remote_pairs`` of its ``origins``
    moved by its δ, judged once per (pieces, δ)."""
    index = members.index

    def keeps(first: OpPieces, delta: int) -> bool:
        for s, d in remote_pairs(first):
            a, b = index.get(s + delta), index.get(d + delta)
            if a is None or b is None or a[0] != b[0]:
                return False
        return True

    return _failing(lowered, origin, keeps)


def ops_splitting_groups(lowered: Lowered, members: TensorMembers,
                         origin: dict[str, tuple[OpPieces, int]] | None = None) -> Iterator[str]:
    """The ops, in graph order, that read a collective whose devices are not whole groups (the
    same set under every ψ_m): each op's ``collective_sets`` of its ``origins`` moved by its δ,
    judged once per (pieces, δ)."""
    index, groups = members.index, members.groups

    def whole(first: OpPieces, delta: int) -> bool:
        for devices in collective_sets(first):
            moved = {d + delta for d in devices}
            at = [index.get(d) for d in moved]
            if any(x is None for x in at) or moved != set().union(*(groups[i] for _, i in at)):
                return False
        return True

    return _failing(lowered, origin, whole)


def _failing(lowered: Lowered, origin: dict[str, tuple[OpPieces, int]] | None,
             judge: Callable[[OpPieces, int], bool]) -> Iterator[str]:
    """The ops of ``lowered`` in graph order whose (pieces, δ) of ``origin`` (``origins``: found
    where None) ``judge`` refuses, each pair judged once."""
    origin = origins(lowered) if origin is None else origin
    verdicts: dict[tuple[int, int], bool] = {}
    for op in lowered.pieces:
        first, delta = origin[op]
        key = (id(first), delta)
        ok = verdicts.get(key)
        if ok is None:
            ok = verdicts[key] = judge(first, delta)
        if not ok:
            yield op
