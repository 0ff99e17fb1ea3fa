"""``per_lowered``: a function of a ``Lowered`` computed once for the last lowering it saw.

A lowering never changes once made (a frozen dataclass whose pieces the lowering's cache
shares), so what is derived from it alone can be kept beside it. One simulation asks for the
same derived facts several times (the task graph, the step end and the memory model each read
the plan's ZeRO uses and every device's run order); a search simulates one lowering after
another, so one entry, compared by identity, serves them all without hashing the plan."""

from __future__ import annotations

import functools
import weakref
from typing import Callable, TypeVar

__all__ = ["per_lowered"]

R = TypeVar("R")


def per_lowered(fn: Callable[..., R]) -> Callable[..., R]:
    """``fn(lowered, *rest)`` computed when ``lowered`` is not the object of the last call, else
    the last result (the same object: callers must not change it); ``rest`` must not change
    the result (what the caller keeps to compute it faster). A call that raises keeps nothing.
    The lowering is held weakly and its result let go with it: a lowering the search has let go
    (a sweep's memory check of a plan that does not fit, a simulated plan's, every op's pieces:
    hundreds of MB at 1,024 devices) is not kept alive by the memo."""
    last: list = [None, None]  # a weak reference to the last lowering, its result

    def gone(ref: weakref.ref) -> None:  # the lowering died: its result goes too
        if last[0] is ref:
            last[0] = last[1] = None

    @functools.wraps(fn)
    def kept(lowered, *rest):
        if last[0] is None or last[0]() is not lowered:
            result = fn(lowered, *rest)
            last[0], last[1] = weakref.ref(lowered, gone), result
        return last[1]
    return kept

