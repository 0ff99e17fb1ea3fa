"""Returning the memory a large simulation freed to the operating system.

glibc's malloc keeps what Python frees: freed arena memory stays mapped, and its dynamic mmap
threshold rises past every large block freed, so later large blocks come from the arenas too.
After a simulation of hundreds of thousands of tasks the process keeps the peak's pages though
it holds far less. ``malloc_trim(0)`` (glibc, malloc(3)) gives back the free pages of every
arena (``madvise(MADV_DONTNEED)`` on whole free pages, the top of the heap unmapped). Elsewhere
(musl, macOS, Windows) ``trim`` does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["TRIM_FROM", "TRIMS", "trim", "trimmed"]

TRIM_FROM = 100_000
"""Tasks from which a simulation's end returns freed memory (``trimmed``): a trim walks every
arena (tens of milliseconds for a heap of gigabytes), a few percent of a simulation of this
many tasks and nothing a search's small folded simulations should pay."""


@lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library is not glibc or the symbol is absent)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
        libc.gnu_get_libc_version  # glibc's own symbol: musl has malloc_trim as a stub
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


@dataclass
class Trims:
    """The trims this process made and the CPU seconds they took (what a benchmark reports)."""
    calls: int = 0
    cpu_s: float = 0.0


TRIMS = Trims()


def trim() -> bool:
    """Return the free pages of every malloc arena to the OS (glibc ``malloc_trim(0)``); False
    where nothing was returned or the C library is not glibc. Never raises."""
    fn = _malloc_trim()
    if fn is None:
        return False
    t0 = time.process_time()
    done = bool(fn(0))
    TRIMS.calls += 1
    TRIMS.cpu_s += time.process_time() - t0
    return done


def trimmed(tasks: int) -> bool:
    """``trim()`` after a simulation of ``tasks`` tasks where they are ``TRIM_FROM`` or more
    (its graph and timeline freed by then); False, and nothing done, below."""
    return tasks >= TRIM_FROM and trim()
