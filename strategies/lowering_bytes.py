"""A lowering cache bounded by bytes (``LoweringCache``): what ``strategies.lowering.lower``'s
cache holds (its ops' pieces, its weights' shards) counted as entries are added and taken out,
each object once however many keys hold it, and the oldest entries dropped past a bound between
calls (``trim``). A dropped entry is lowered again when asked: a bound changes speed, never
results."""

from __future__ import annotations

from typing import Any

from strategies.lowered import OpPieces
from strategies.lowering import is_patched_state
from strategies.lowering_cache import Held
from strategies.renamed_rows import records

__all__ = ["LOWERING_BYTES", "RECORD_BYTES", "LoweringCache", "counted", "entry_bytes", "held_bytes", "item_bytes",
           "key_bytes", "pieces_bytes"]

LOWERING_BYTES = 256 << 20
"""The bytes (``pieces_bytes``, ``held_bytes``) a search's lowering cache holds before its oldest
entries go (``LoweringCache.trim``). An op's pieces grow with the devices it is cut over
(GPT-3 175B data parallel on 128 devices: 4.9 MB for 200 ops), so a count of entries per op
does not bound a search's memory."""

RECORD_BYTES = 216
"""Bytes one record of an op's pieces (a partition, transfer, reduction group, weight read or
collective read; a weight shard) keeps alive with the boxes, regions and ints past 256 it alone
names: an 8- or 11-field tuple (104 or 128 bytes, ``sys.getsizeof``) and its boxes' tuples.
Measured two ways on GPT (zoo ``gpt``): the distinct tuples and ints a cache's records reach,
walked record by record, 201 bytes a record (64 devices, factorizations) and 231 (16 devices,
one-op proposals); what the pieces free under tracemalloc once only task blocks hold them, 215
(16 devices, 13 plans). Where other memos hold the same boxes (the cost model's keys, the
shapes' regions) less is freed when a holder lets go: a lowering cache of one-op proposals at 16
devices frees 88 bytes a record (``tests/search/test_lowering_held.py``), one of factorizations
at 64 devices 179. One constant for the lowering cache and the task blocks
(``simulator.block_bytes``)."""

_SLOT = 8
"""Bytes of one entry of a per-device tuple (a pointer; small ints are shared); ``_TUPLE`` its
header."""
_TUPLE = 40
_INT = 32
"""Bytes of an int outside CPython's shared small ints (-5..256): 28, as the allocator rounds."""
_HELD = 56
"""Bytes of the count's own record of one object (``LoweringCache._held``: a 3-slot list and
the dict's slot): 53 an object freed under tracemalloc on GPT's factorizations at 64 devices."""


def key_bytes(key: Any) -> int:
    """Bytes a cache key holds alone: its tuples (plain ``tuple``s, nested; a device set's
    ``Hashed`` tuple is its config's) and their ints past 256. A key of a copy-0 or member
    lowering names every device of its op's and producers' configs (``strategies.lowering_shared
    .relative_key``) while its pieces keep the kept devices' records only: at 1,024 devices the
    key outweighs them."""
    if type(key) is not tuple:
        return 0
    total, stack = 0, [key]
    while stack:
        t = stack.pop()
        total += _TUPLE + _SLOT * len(t)
        for x in t:
            if type(x) is tuple:
                stack.append(x)
            elif type(x) is int and not -5 <= x <= 256:
                total += _INT
    return total


def pieces_bytes(pieces: OpPieces) -> int:
    """What an op's pieces hold besides their per-device tuples (``_per_device``, counted
    apart: renamed pieces share them): ``RECORD_BYTES`` a record."""
    return RECORD_BYTES * (records(pieces.partitions) + len(pieces.transfers) + len(pieces.reductions)
                           + len(pieces.weight_reads) + len(pieces.collective_reads))


def _per_device(pieces: OpPieces) -> tuple[tuple[int, ...], ...]:
    """An op's per-device tuples (activations, receives, dropped): one entry a device each."""
    return pieces.activations, pieces.receives[0], pieces.receives[1], pieces.dropped


def held_bytes(held: Held) -> int:
    """What a weight's shards hold: ``RECORD_BYTES`` a shard, its per-device arrays' bytes."""
    return RECORD_BYTES * len(held.shards) + held.per_device.nbytes + held.holders.nbytes


def counted(value: Any) -> list[Any]:
    """The pieces, their per-device tuples and the shards a cache entry's ``value`` holds (a
    tuple's items one deep; a ``Held``'s readers' pieces too: it keeps them alive)."""
    if type(value) is tuple:
        items = [v for v in value if type(v) is OpPieces or type(v) is Held]
    else:
        items = [value] if type(value) is OpPieces or type(value) is Held else []
    out = []
    for item in items:
        out.append(item)
        for pieces in ((item,) if type(item) is OpPieces else item.read_by):
            if pieces is not item:
                out.append(pieces)
            out.extend(_per_device(pieces))
    return out


def item_bytes(item: Any) -> int:
    """``pieces_bytes``, ``held_bytes`` or a per-device tuple's bytes."""
    if type(item) is OpPieces:
        return pieces_bytes(item)
    if type(item) is Held:
        return held_bytes(item)
    return _TUPLE + _SLOT * len(item)


def entry_bytes(item: Any) -> int:
    """``item_bytes`` with the ``LoweringCache``'s own record of the object (``_HELD``)."""
    return _HELD + item_bytes(item)


class LoweringCache(dict):
    """A dict ``lower`` reads and writes whose ``nbytes`` is ``entry_bytes`` of every distinct
    pieces, per-device tuple and shards object its entries hold (``counted``) and ``key_bytes``
    of its keys (``Last``, the state ``lower``
    patches in place, holds one plan's pieces besides). ``trim``: past ``limit``, the oldest
    entries go until half of it is held. A nested cache (a precision's) is one too, with its
    own count and bound."""

    def __init__(self, limit: int = LOWERING_BYTES):
        super().__init__()
        self.limit = limit
        self.nbytes = 0
        self._held: dict[int, list] = {}
        """id -> [the object, entries holding it, its bytes]."""
        self._nested: dict[Any, LoweringCache] = {}
        """Key -> the nested cache under it (a precision's): what ``trim`` and ``total`` visit,
        not every entry."""

    def _add(self, value: Any) -> None:
        for item in counted(value):
            got = self._held.get(id(item))
            if got is None:
                size = entry_bytes(item)
                self._held[id(item)] = [item, 1, size]
                self.nbytes += size
            else:
                got[1] += 1

    def _release(self, value: Any) -> None:
        for item in counted(value):
            got = self._held[id(item)]
            got[1] -= 1
            if not got[1]:
                del self._held[id(item)]
                self.nbytes -= got[2]

    def __setitem__(self, key: Any, value: Any) -> None:
        old = dict.get(self, key)
        if old is None and not dict.__contains__(self, key):
            self.nbytes += key_bytes(key)
        dict.__setitem__(self, key, value)
        if isinstance(value, LoweringCache):
            self._nested[key] = value
        elif old is not None and key in self._nested:
            del self._nested[key]
        self._add(value)
        if old is not None:
            self._release(old)

    def _forget(self, key: Any, value: Any) -> None:
        """The count of an entry taken out: its key, its value's objects, its nested cache."""
        self._nested.pop(key, None)
        self._release(value)
        self.nbytes -= key_bytes(key)

    def __delitem__(self, key: Any) -> None:
        self._forget(key, dict.pop(self, key))

    def pop(self, key: Any, *default: Any) -> Any:
        if not dict.__contains__(self, key):
            return dict.pop(self, key, *default)
        value = dict.pop(self, key)
        self._forget(key, value)
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
        self._nested.clear()
        self.nbytes = 0

    def popitem(self) -> tuple[Any, Any]:
        key, value = dict.popitem(self)
        self._forget(key, value)
        return key, value

    def total(self) -> int:
        """``nbytes`` with the nested caches'."""
        return self.nbytes + sum(v.total() for v in self._nested.values())

    def trim(self) -> bool:
        """Past ``limit`` (this cache's or a nested one's): the oldest entries dropped until half
        of it is held, and the state ``lower`` patches (``strategies.lowering.is_patched_state``:
        its last lowering names entries by their keys) dropped with them, so the next call lowers
        afresh from what is kept. Between calls only. Whether anything was dropped."""
        dropped = False
        for value in list(self._nested.values()):
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
