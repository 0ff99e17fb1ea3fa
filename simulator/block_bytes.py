"""What a ``TaskCache``'s task blocks keep alive, counted each object once (``HeldBytes``).

A block (``simulator.tasks._Block``) keeps its arrays, the per-task lists its ``Segment`` keeps
beside them for readers (``Columns``: labels, durations, resources, devices, bytes), its step
lists (``fwd``, ``fwd_done``, ``bwd_done``: local ids per micro-batch and partition) and its
pieces (their records, ``RECORD_BYTES`` each, and per-device tuples,
``strategies.lowering_bytes``), which stay alive
while the block does after the lowering cache has let them go. A twin's block shares its
source's duration and bytes lists and arrays (``simulator.twins``), renamed pieces share their
per-device tuples, and a block can be the current one of a state, a known one and a recorded
gather's reader at once: each object is counted once however many blocks hold it. The sizes are
CPython's ``sys.getsizeof`` of each object (lists and tuples: their header and one pointer an
item; a float 24 bytes; an int past the small ints 28; a 4-tuple label 72), summed with the
items the lists hold by a size an item (``ITEM_BYTES``), not walked item by item: a count per
block is a few lengths."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from strategies.lowering_bytes import counted, item_bytes

__all__ = ["HeldBytes", "ITEM_BYTES", "STEP_ITEM_BYTES", "Uncounted", "block_items"]

ITEM_BYTES = {"name": 72, "duration": 24, "resources": 48, "device": 0, "nbytes": 0, "category": 0}
"""Bytes an item of each ``Columns`` list holds besides its pointer (``sys.getsizeof`` in CPython
3.11): a label is a 4-tuple (what, op, index, micro-batch; its strings are the graph's), a
duration a float, resources a 1-tuple (a transfer's a few more links); devices, bytes and
categories are ints, shared where small (a device past 256 is one object a partition's tasks
share; a transfer's bytes, one a transfer, are counted with its pieces)."""

STEP_ITEM_BYTES = 8 + 28
"""An item of a block's step lists (``fwd``, ``fwd_done``, ``bwd_done``): its pointer and the
int of a local id (past 256 for all but a block's first tasks)."""


_ENTRY_BYTES = 88 + 32 + 2 * 112
"""What ``HeldBytes`` spends on a held block besides its objects: its entry's list (88), its id
(32) and its two arrays' headers (112 each); ``_ITEM_BOOK`` an object of it (an item of each
array) and ``_HOLDER_BYTES`` a distinct object (its holders' entry: an id, a count, a slot)."""
_ITEM_BOOK = 16
_HOLDER_BYTES = 140


def _list_bytes(items: Any, per_item: int) -> int:
    """A list's ``sys.getsizeof`` and ``per_item`` for each item (a twin's lazily named labels,
    ``twins._Names``: the list they make once read)."""
    if type(items) is not list:
        made = getattr(items, "_list", None)
        return sys.getsizeof(items) + (0 if made is None else _list_bytes(made, per_item))
    return sys.getsizeof(items) + per_item * len(items)


def _steps_bytes(rows: list) -> int:
    """A block's ``fwd``/``fwd_done``/``bwd_done``: a list a micro-batch of local ids (a dict by
    partition index where the plan is folded)."""
    return sys.getsizeof(rows) + sum(sys.getsizeof(r) + STEP_ITEM_BYTES * len(r) for r in rows)


def block_items(block: Any) -> list[tuple[Any, int]]:
    """The objects ``block`` keeps alive with their bytes: its arrays, each list of its columns,
    its step lists (one object: the block's own) and its pieces' records and per-device tuples."""
    cols = block.cols
    out = [(a, a.nbytes) for a in block.arrays]
    out += [(getattr(cols, f), _list_bytes(getattr(cols, f), n)) for f, n in ITEM_BYTES.items()]
    out.append((block.fwd, _steps_bytes(block.fwd) + _steps_bytes(block.fwd_done) + _steps_bytes(block.bwd_done)))
    out += [(item, item_bytes(item)) for item in counted(block.pieces)]
    return out


class _Held:
    """A held block: the block (kept, so its id and its objects' stay their own), its holders,
    the ids of the objects it keeps alive and their bytes (``block_items``, as when first held)."""

    __slots__ = ("block", "holders", "ids", "sizes")

    def __init__(self, block: Any, ids: np.ndarray, sizes: np.ndarray) -> None:
        self.block, self.holders, self.ids, self.sizes = block, 1, ids, sizes


class HeldBytes:
    """Blocks held by any number of holders (a state's current blocks, the known ones, the
    recorded gathers' readers), each object they keep alive counted once (``nbytes``) while one
    holds it: ``add`` and ``release`` a holder's block."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._blocks: dict[int, _Held] = {}
        """id of a held block -> its entry."""
        self._holders: dict[int, int] = {}
        """id of an object a held block keeps alive -> the held blocks keeping it."""

    def add(self, block: Any) -> None:
        got = self._blocks.get(id(block))
        if got is not None:
            got.holders += 1
            return
        items = block_items(block)
        ids = np.fromiter((id(obj) for obj, _ in items), np.int64, len(items))
        sizes = np.fromiter((size for _, size in items), np.int64, len(items))
        self._blocks[id(block)] = _Held(block, ids, sizes)
        self.nbytes += _ENTRY_BYTES + _ITEM_BOOK * len(items)
        holders = self._holders
        for i, size in zip(ids.tolist(), sizes.tolist()):
            n = holders.get(i, 0)
            holders[i] = n + 1
            if not n:
                self.nbytes += size + _HOLDER_BYTES

    def release(self, block: Any) -> None:
        got = self._blocks[id(block)]
        got.holders -= 1
        if got.holders:
            return
        del self._blocks[id(block)]
        self.nbytes -= _ENTRY_BYTES + _ITEM_BOOK * len(got.ids)
        holders = self._holders
        for i, size in zip(got.ids.tolist(), got.sizes.tolist()):
            n = holders[i] - 1
            if n:
                holders[i] = n
            else:
                del holders[i]
                self.nbytes -= size + _HOLDER_BYTES

    def size(self, block: Any) -> int:
        """What a held ``block`` keeps alive, alone, as counted when first held (a twin's labels
        made later do not move it, so what ``hold`` adds ``_forget`` takes away)."""
        return int(self._blocks[id(block)].sizes.sum())

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)


class Uncounted(HeldBytes):
    """``HeldBytes`` that counts nothing: the task cache ``simulator.tasks.build_tasks`` makes
    for one call (none given) is let go with its graph and never trimmed, so walking every
    block's objects (``block_items``) would only cost time."""

    def add(self, block: Any) -> None:
        pass

    def release(self, block: Any) -> None:
        pass

    def size(self, block: Any) -> int:
        return 0
