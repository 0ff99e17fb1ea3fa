"""A lowering cache for a trial: reads fall through to the search's cache, writes stay apart.

The sweep (``sweep.py``) lowers every factorization to read its peak memory before timing it.
At 1,024 devices each lowering adds thousands of entries (every op's pieces, every weight's
shards over its holders, a copy set's last lowering) to the cache ``strategies.lowering.lower``
patches; a plan that does not fit is never simulated, and its entries only held memory (GPT-3
175B on a100-128x8: the process grew to 12.8 GB). ``Scratch`` gives the trial the search's
entries to reuse and keeps its own apart: ``keep`` moves them into the search's cache (a plan
that fits, simulated next from them), dropping it forgets them.

The state ``lower`` patches in place from call to call (``strategies.lowering.is_patched_state``:
a copy set's last lowering and bucket split) is not read from the base: the trial
builds its own, from the base's pieces, so the base never holds what only the trial does
(its shards are keyed by the ids of the pieces read, which stay sound only while the cache
holding the key holds the pieces).
"""

from __future__ import annotations

from typing import Any

from strategies.lowering import is_patched_state

__all__ = ["Scratch"]


class Scratch(dict):
    """The cache ``lower`` reads and writes (``get``, ``[]=``, ``setdefault``, ``pop``) over
    ``base``, which it only reads; a nested cache (a precision's, ``strategies.lowering``) is
    a ``Scratch`` over the base's."""

    def __init__(self, base: dict):
        super().__init__()
        self.base = base

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        if is_patched_state(key):
            return default
        return self.base.get(key, default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        below = self.base.get(key)
        if isinstance(below, dict):
            got = Scratch(below)
        elif below is not None:
            return below
        else:
            got = Scratch({}) if isinstance(default, dict) and not default else default
        dict.__setitem__(self, key, got)
        return got

    def keep(self) -> None:
        """Move this trial's entries into the base (nested ones into the base's nested)."""
        for key, value in dict.items(self):
            if isinstance(value, Scratch):
                value.keep()
                self.base.setdefault(key, value.base)
            else:
                self.base[key] = value
        dict.clear(self)

