"""The pace of a search's steps, so that a step that would end past the time budget does not
start: each kind of step (a baseline's scoring, by name; the op moves' space for a count of
micro-batches; a sweep's timed plan; a chain's start; a proposal, by move kind) keeps the running mean of its seconds, and the next one of that kind
is predicted to take that long. A kind ``family/name`` not yet timed is predicted by its
family's mean (any baseline's, any proposal's), a family not yet timed by the least mean of the
families timed so far (none timed: it starts), so a chain's first proposal after slow baselines
waits for room for one of them.

A scored plan that leads the search is summarized at once from its own timeline
(``evaluator.Evaluator.summarize_best``; kind "summary": that pass alone), so nothing is simulated
after the chains, and a step that may lead is predicted with a summary's pass after it. The
search's last step then ends within the budget plus that step's error against its prediction."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["SPACE", "SUMMARY", "Pace"]

SPACE = "space"
"""The kind of building the op moves' space for one count of micro-batches (``moves.Moves.space``:
every op's configs, one list per op signature, its group moves' neighbours and block moves): the
search's own count before the chains, a chain's start at another count before its first draw."""

SUMMARY = "summary"
"""The kind of a summary's pass (busy times, bytes moved, the peak's breakdown) after a
simulation: part of a step, not one, so no other kind is predicted by it."""


@dataclass
class Pace:
    """Running mean seconds per kind of step (``timed``, ``record``) and whether the next step
    of a kind ends by a deadline (``fits``)."""

    totals: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Kind -> (steps timed, their seconds); a ``family/name`` kind's steps count in its
    family's too."""

    def record(self, kind: str, seconds: float) -> None:
        family = kind.split("/", 1)[0]
        for k in {kind, family}:
            count, total = self.totals.get(k, (0, 0.0))
            self.totals[k] = (count + 1, total + seconds)

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Records the seconds the ``with`` body takes as one step of ``kind``."""
        t0 = time.perf_counter()
        yield
        self.record(kind, time.perf_counter() - t0)

    def mean(self, kind: str) -> float | None:
        """The mean seconds of the steps of ``kind`` timed so far (None: none)."""
        count, total = self.totals.get(kind, (0, 0.0))
        return total / count if count else None

    def predict(self, kind: str) -> float:
        """Seconds the next step of ``kind`` is expected to take: its kind's mean, else its
        family's, else the least mean of any family (a summary's pass excepted), else 0."""
        for k in (kind, kind.split("/", 1)[0]):
            mean = self.mean(k)
            if mean is not None:
                return mean
        return min((t / c for k, (c, t) in self.totals.items() if "/" not in k and k != SUMMARY), default=0.0)

    def fits(self, kind: str, deadline: float | None, then: str | None = None) -> bool:
        """A step of ``kind`` started now, and a step of ``then`` after it where that kind was
        timed before (a summary's pass, where the step's result leads), ends by ``deadline``
        (``time.perf_counter()``; None: no deadline) as predicted."""
        if deadline is None:
            return True
        after = (self.mean(then) or 0.0) if then is not None else 0.0
        return time.perf_counter() + self.predict(kind) + after <= deadline
