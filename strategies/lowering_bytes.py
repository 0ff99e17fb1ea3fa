"""A lowering cache bounded by bytes (``LoweringCache``): what ``strategies.lowering.lower``'s
cache holds (its ops' pieces, its weights' shards) counted as entries are added and taken out,
each object once however many keys hold it, and the oldest entries dropped past a bound between
calls (``trim``). A dropped entry is lowered again when asked: a bound changes speed, never
results."""

from __future__ import annotations

from typing import Any, Iterable

from strategies.lowered import OpPieces
from strategies.lowering import is_patched_state
from strategies.lowering_cache import Held

__all__ = ["LOWERING_BYTES", "RECORD_BYTES", "LoweringCache", "held_bytes", "pieces_bytes"]

LOWERING_BYTES = 256 << 20
"""The bytes (``pieces_bytes``, ``held_bytes``) a search's lowering cache holds before its oldest
entries go (``LoweringCache.trim``). An op's pieces grow with the devices it is cut over
(GPT-3 175B data parallel on 128 devices: 4.9 MB for 200 ops), so a count of entries per op
does not bound a search's memory."""

RECORD_BYTES = 96
"""Bytes one record of an op's pieces (a partition, transfer, reduction group, weight read or
collective read; a weight shard) holds with its share of the boxes it names: about a record's
``sys.getsizeof`` with the boxes shared between records counted once."""

_SLOT = 8
"""Bytes of one entry of a per-device tuple (a pointer; small ints are shared)."""


def pieces_bytes(pieces: OpPieces) -> int:
    """What an op's pieces hold: ``RECORD_BYTES`` a record, ``_SLOT`` a per-device entry."""
    records = (sum(map(len, pieces.partitions)) + len(pieces.transfers) + len(pieces.reductions)
               + len(pieces.weight_reads) + len(pieces.collective_reads))
    slots = len(pieces.activations) + len(pieces.receives[0]) + len(pieces.receives[1]) + len(pieces.dropped)
    return RECORD_BYTES * records + _SLOT * slots


def held_bytes(held: Held) -> int:
    """What a weight's shards hold: ``RECORD_BYTES`` a shard, its per-device arrays' bytes."""
    return RECORD_BYTES * len(held.shards) + held.per_device.nbytes + held.holders.nbytes


def _counted(value: Any) -> Iterable[Any]:
    """The pieces and shards an entry's value holds (a tuple's items one deep; a ``Held``'s
    readers' pieces too: it keeps them alive)."""
    if type(value) is OpPieces:
        return (value,)
    if type(value) is Held:
        return (value, *value.read_by)
    if type(value) is tuple:
        return [v for v in value if type(v) is OpPieces or type(v) is Held]
    return ()


def _bytes(item: Any) -> int:
    return pieces_bytes(item) if type(item) is OpPieces else held_bytes(item)


class LoweringCache(dict):
    """A dict ``lower`` reads and writes whose ``nbytes`` is ``pieces_bytes`` + ``held_bytes`` of
    every distinct pieces and shards object its entries hold (``Last``, the state ``lower``
    patches in place, holds one plan's pieces besides). ``trim``: past ``limit``, the oldest
    entries go until half of it is held. A nested cache (a precision's) is one too, with its
    own count and bound."""

    def __init__(self, limit: int = LOWERING_BYTES):
        super().__init__()
        self.limit = limit
        self.nbytes = 0
        self._held: dict[int, list] = {}
        """id -> [the object, entries holding it, its bytes]."""

    def _add(self, value: Any) -> None:
        for item in _counted(value):
            got = self._held.get(id(item))
            if got is None:
                size = _bytes(item)
                self._held[id(item)] = [item, 1, size]
                self.nbytes += size
            else:
                got[1] += 1

    def _release(self, value: Any) -> None:
        for item in _counted(value):
            got = self._held[id(item)]
            got[1] -= 1
            if not got[1]:
                del self._held[id(item)]
                self.nbytes -= got[2]

    def __setitem__(self, key: Any, value: Any) -> None:
        old = dict.get(self, key)
        dict.__setitem__(self, key, value)
        self._add(value)
        if old is not None:
            self._release(old)

    def __delitem__(self, key: Any) -> None:
        self._release(dict.pop(self, key))

    def pop(self, key: Any, *default: Any) -> Any:
        if not dict.__contains__(self, key):
            return dict.pop(self, key, *default)
        value = dict.pop(self, key)
        self._release(value)
        return value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        if isinstance(default, dict) and not isinstance(default, LoweringCache):  # a nested cache
            nested = LoweringCache(self.limit)
            nested.update(default)
            default = nested
        self[key] = default
        return default

    def update(self, *args: Any, **kw: Any) -> None:
        for key, value in dict(*args, **kw).items():
            self[key] = value

    def clear(self) -> None:
        dict.clear(self)
        self._held.clear()
        self.nbytes = 0

    def popitem(self) -> tuple[Any, Any]:
        key, value = dict.popitem(self)
        self._release(value)
        return key, value

    def total(self) -> int:
        """``nbytes`` with the nested caches'."""
        return self.nbytes + sum(v.total() for v in dict.values(self) if isinstance(v, LoweringCache))

    def trim(self) -> bool:
        """Past ``limit`` (this cache's or a nested one's): the oldest entries dropped until half
        of it is held, and the state ``lower`` patches (``strategies.lowering.is_patched_state``:
        its last lowering names entries by their keys) dropped with them, so the next call lowers
        afresh from what is kept. Between calls only. Whether anything was dropped."""
        dropped = False
        for value in list(dict.values(self)):
            if isinstance(value, LoweringCache):
                dropped = value.trim() or dropped
        if self.nbytes <= self.limit:
            return dropped
        for key in [k for k in dict.keys(self) if is_patched_state(k)]:
            del self[key]
        for key in list(dict.keys(self)):
            if self.nbytes <= self.limit // 2:
                break
            if not isinstance(dict.__getitem__(self, key), LoweringCache):
                del self[key]
        return True
