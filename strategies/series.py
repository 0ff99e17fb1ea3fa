"""An op's micro-batches as a series. ``series(a, b)``: a value given at two consecutive
micro-batches, continued: f with f(0) == a and f(1) == b where every int field of ``b`` is its
field of ``a`` plus a step, every other field equal, and f(t) the same with t steps.

Where an op and every activation it reads have a sample dim, its pieces of micro-batch j are
micro-batch j − 1's with their sample rows moved on by one micro-batch's rows
(``strategies.pieces.grid_of``: micro-batch j starts at row j·B/m; ``check_microbatches``: each
reads within its own micro-batch's rows); its partitions' devices and bytes are the same in
every micro-batch. So ``microbatches`` (for ``strategies.pieces.lower_op``) derives micro-batches
0, 1, 2 and the last, and takes the others from the series of 1 and 2 where it reproduces the
last exactly and the device pairs agree; an op without a sample dim reading one (``h[37]``: a
row of one micro-batch only) has each derived. Shared sub-values stay
shared: a NamedTuple two fields of ``a`` hold (a ``Collective`` its readers share) is one object
in every f(t), and is so in ``b`` or there is no series; a plain tuple (a box) is only equal
wherever ``a`` held it."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["series", "microbatches", "Microbatch", "SERIES_FROM"]

_new = tuple.__new__

SERIES_FROM = 8
"""From this many micro-batches on, ``microbatches`` derives micro-batches 0, 1, 2 and the last and
takes the others from the series of 1 and 2 where it gives the last."""


class Microbatch(NamedTuple):
    """One micro-batch's share of an op's pieces (``strategies.pieces.lower_op``)."""

    partitions: tuple
    transfers: tuple
    reads: tuple
    """The collective reads."""
    couples: frozenset
    """The device pairs its transfers and collectives join."""

    @property
    def pieces(self) -> tuple:
        """(partitions, transfers, reads): what the series continues."""
        return self.partitions, self.transfers, self.reads


def microbatches(one: Callable[[int], Microbatch], m: int, alike: bool) -> list[Microbatch]:
    """``one(j)`` for j = 0 .. m − 1. ``alike``: the op and the activations it reads have sample
    dims (module docstring); from ``SERIES_FROM`` micro-batches the interior ones are then taken
    from the series of micro-batches 1 and 2 where it reproduces the last one exactly; else, or
    where the last raises, each is derived in order."""
    if m < SERIES_FROM or not alike:
        return [one(j) for j in range(m)]
    head = [one(0), one(1), one(2)]
    second, third = head[1], head[2]
    f = series(second.pieces, third.pieces) if second.couples == third.couples else None
    last = None
    if f is not None:
        try:
            last = one(m - 1)
        except Exception:  # raised again below, by the first micro-batch in order that raises
            f = None
    if f is None or last.couples != second.couples or f(m - 2) != last.pieces:
        rest = [one(j) for j in range(3, m - 1)]
        return head + rest + [one(m - 1) if last is None else last]  # the last derived once
    return head + [Microbatch(*f(j - 1), second.couples) for j in range(3, m - 1)] + [last]


class _Differ(Exception):
    """``a`` and ``b`` are not two terms of one series."""


def series(a: Any, b: Any) -> Callable[[int], Any] | None:
    """f(t): ``a`` moved on t times by the steps from ``a`` to ``b`` (module docstring); None where
    ``a`` and ``b`` differ other than in their int fields (a type, a length, another field, what
    they share)."""
    try:
        node, const = _compile(a, b, {}, {})
    except _Differ:
        return None
    if const:
        return lambda t: a
    return lambda t: node(t, {})


def _compile(a: Any, b: Any, seen: dict, seen_b: dict) -> tuple[Any, bool]:
    """(a node called as node(t, memo), False), or (``a``, True) where every f(t) is ``a``."""
    if a is b:
        return a, True
    kind = type(a)
    if kind is not type(b):
        raise _Differ
    if kind is int:
        if a == b:
            return a, True
        step = b - a
        return (lambda t, memo: a + step * t), False
    if not isinstance(a, tuple) or (kind is not tuple and not hasattr(kind, "_fields")):
        if a != b:  # not a plain tuple nor a NamedTuple (a ``Hashed`` group of devices): kept as it is
            raise _Differ
        return a, True
    named = kind is not tuple  # a NamedTuple: what ``a`` shares ``b`` shares alike; a box: equal is enough
    if named:
        got = seen.get(id(a))
        if got is not None:
            partner, node, const = got
            if partner is not b:
                raise _Differ
            return node, const
        if id(b) in seen_b:
            raise _Differ
    if len(a) != len(b):
        raise _Differ
    fields = [_compile(x, y, seen, seen_b) for x, y in zip(a, b)]
    if all(const for _, const in fields):
        out = (a, True)
    elif kind is tuple and all(type(x) is int for x in a) and all(type(y) is int for y in b):
        starts, steps = a, tuple(y - x for x, y in zip(a, b))  # a box's range: ints alone
        out = (lambda t, memo: tuple([s + d * t for s, d in zip(starts, steps)])), False
    else:
        parts = tuple(fields)
        if kind is tuple:  # a box: equal in every place that held it (not one object)
            def node(t, memo, parts=parts):
                return tuple([v if const else v(t, memo) for v, const in parts])
            out = (node, False)
        else:  # a NamedTuple, made as the tuple it is, once a call
            def node(t, memo, parts=parts, kind=kind):
                return _new(kind, [v if const else v(t, memo) for v, const in parts])
            out = (_shared(node, id(a)), False)
    if named:
        seen[id(a)] = (b, *out)
        seen_b[id(b)] = a
    return out


def _shared(node: Callable, key: int) -> Callable:
    """``node`` made once a call of f: every place that held one object holds one again."""
    def once(t, memo):
        got = memo.get(key)
        if got is None:
            got = memo[key] = node(t, memo)
        return got
    return once
