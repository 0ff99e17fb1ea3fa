"""The state ``strategies.lowering.lower`` keeps in its cache between calls: the previous
call's lowering (``Last``), which the next call patches where configs changed, and each
weight's shards. Invariant: a patched lowering equals one lowered from scratch
(tests/strategies/test_lowering.py checks it plan by plan)."""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, NamedTuple, Sequence

import numpy as np

from strategies.drops import recompute_key
from strategies.graph import OpGraph, OpNode
from strategies.lowered import DeviceBytes, OpPieces, Partition, WeightShard, weight_shards
from strategies.lowering_copies import expand_holders
from strategies.lowering_memo import levels_key, relevelled
from strategies.lowering_shared import name_map, names_of, relative_key, renamed
from strategies.members import Members
from strategies.pieces import lower_op, shape_ids
from strategies.region import Box
from strategies.strategy import Strategy
from strategies.symmetry import Copies

__all__ = ["Held", "Last", "changed_ops", "same_objects", "update"]


def same_objects(a: Sequence, b: Sequence) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in the same order (identity, not equality:
    a piece made again is new work even where it compares equal)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def changed_ops(last: "Last | None", configs: tuple[tuple[str, Any], ...]) -> list[str] | None:
    """The ops whose config is not the very object of the last call's plan, or None when
    the plans do not name the same ops in the same order. One C-level pass finds the
    (name, config) pairs that are not the last plan's (``Strategy.replace`` makes one)."""
    if last is None or len(last.configs) != len(configs):
        return None
    previous = last.configs
    out = []
    for i in itertools.compress(range(len(configs)), map(operator.is_not, previous, configs)):
        (name, a), (other, b) = previous[i], configs[i]
        if name != other:
            return None
        if a is not b:
            out.append(name)
    return out


def update(graph: OpGraph, strategy: Strategy, cache: dict, last: "Last", affected: list[OpNode]) -> None:
    """``last`` made ``strategy``'s lowering: the ``affected`` ops' pieces, in graph order, the
    shards of every weight they read (in the previous call's pieces or this call's) and the totals;
    of copy 0's devices where ``last.copies`` (``strategies.lowering_copies``)."""
    m = strategy.microbatches
    keep = None if last.copies is None else last.copies.kept
    mine = None if keep is None else sorted(keep)
    kept, received, received_grad = last.totals[:3]
    config = strategy.__getitem__
    weights: set[str] = set()  # read by an affected op, in the previous call's pieces or this call's
    regroup = last.readers is None  # an op reads other weights than in the previous call: readers gathered again
    shapes = shape_ids(graph)
    for node in affected:
        by = (m, strategy.num_devices, config(node.name), tuple(map(config, node.inputs)),
              recompute_key(graph, strategy, node.name), keep)
        key = (node.name, *by)
        pieces = cache.get(key)
        shape = (shapes[node.name], *by)
        names = last.names(node.name)
        if pieces is None:
            pieces = cache[key] = _lowered(graph, strategy, cache, node, shape, names, key)
        last.shaped[node.name] = shape
        first = cache.get(shape)  # the op these pieces rename, where they do
        if first is not None and first[1] is not pieces and name_map(first[0], names) is not None:
            last.twins[node.name] = (first[0][0], first[1], 0)
        else:
            moved = cache.get((_MOVED, key))  # renamed and moved (another stage's layer)
            if moved is not None and moved[0] is pieces:
                last.twins[node.name] = moved[1:]
            else:
                last.twins.pop(node.name, None)
        old = last.by_op.get(node.name)
        if old is pieces:
            continue
        # copy 0's: its devices' entries only (a weight op keeps and receives nothing)
        _patch(kept, old and old.activations, pieces.activations, mine)
        _patch(received, old and old.receives[0], pieces.receives[0], mine)
        _patch(received_grad, old and old.receives[1], pieces.receives[1], mine)
        last.by_op[node.name] = pieces
        last.partitions[node.name] = pieces.partitions
        weights.update(pieces.weights_read)
        if old is not None:
            weights.update(old.weights_read)
            regroup = regroup or old.weights_read != pieces.weights_read
    if regroup:
        last.regroup(graph)
        weights = set(last.readers) | set(last.held)
    for name in weights:
        last.hold(name, cache)
    if regroup:
        last.held = {name: last.held[name] for name in last.readers}  # the readers' order


_MOVED = "moved"
"""The first item of the cache's keys of (pieces, op, its pieces, delta) where an op's pieces
are that op's renamed and moved delta on (``Lowered.twins``)."""

_RELATIVE = "relative"
"""The first item of the cache's keys of pieces by configs relative to their op's first device
(``lowering_shared.relative_key``)."""


def _lowered(graph: OpGraph, strategy: Strategy, cache: dict, node: OpNode, shape: tuple,
             names: tuple[str, ...], key: tuple) -> OpPieces:
    """``node``'s pieces (its names ``names``, ``names_of``), the first found of: its own pieces
    under other sharding levels, relevelled (``strategies.lowering_memo``: the same partitions,
    transfers and reductions, so the task blocks built for them serve too); another op's of the
    same ``shape`` (its id and the configs it is lowered under) renamed
    (``strategies.lowering_shared``); another op's of that shape under other levels renamed
    and relevelled; those of an op of its shape cut alike on devices moved by one offset
    (``lowering_shared.relative_key``: the same layer in another pipeline stage) renamed and
    moved (kept under ``(_MOVED, key)`` with that op, its pieces and the move: ``Lowered.twins``);
    else lowered. The config is validated where the pieces are not another op's of the
    same ``shape``, and the pieces are kept for the others."""
    levels = levels_key(shape, strategy, node)
    own = cache.get((node.name, *levels))
    if own is not None:
        strategy.validate_op(node)
        pieces = relevelled(own, graph, strategy, node)
        if pieces is not None:
            return pieces
    first = cache.get(shape)
    if first is not None:
        pieces = renamed(first[1], first[0], names)
        if pieces is not None:
            cache[(node.name, *levels)] = pieces
            return pieces
    other = cache.get(levels)
    pieces = None
    if other is not None:
        pieces = renamed(other[1], other[0], names)
        if pieces is not None:
            strategy.validate_op(node)
            pieces = relevelled(pieces, graph, strategy, node)
    alike = None
    if pieces is None:
        config = strategy.__getitem__
        relative, base = relative_key(config(node.name), tuple(map(config, node.inputs)), shape[-1])
        relative = (_RELATIVE, shape[0], *shape[1:3], relative, *shape[5:-1])
        alike = cache.get(relative)
        if alike is not None:
            strategy.validate_op(node)
            pieces = renamed(alike[1], alike[0], names, base - alike[2])
            if pieces is not None:
                cache[(_MOVED, key)] = (pieces, alike[0][0], alike[1], base - alike[2])
    if pieces is None:
        strategy.validate_op(node)
        pieces = lower_op(graph, strategy, node, shape[1], shape[-1])
        if other is None:
            cache[levels] = (names, pieces)
        if alike is None:
            cache[relative] = (names, pieces, base)
    if first is None:
        cache[shape] = (names, pieces)
    cache[(node.name, *levels)] = pieces
    return pieces


class Held(NamedTuple):
    """One weight's shards, given the pieces of the ops reading it (``read_by``, kept so the
    cache's key by their ids stays sound), and what they add to the per-device totals."""

    read_by: tuple[OpPieces, ...]
    shards: list[WeightShard]
    per_device: np.ndarray
    """Bytes of the shards each device holds."""
    holders: np.ndarray
    """Trainable only: the devices holding a shard."""


class Last:
    """The previous call's lowering of one graph (per micro-batch and device count), which the
    next call patches: each op's pieces, each weight's shards (in the order their first reader
    comes in the graph) and the per-device totals over them."""

    def __init__(self, graph: OpGraph, n: int, copies: Copies | None = None):
        self.graph = graph
        self.copies = copies
        """The copies whose copy 0 is lowered (None: every device)."""
        self.shaped: dict[str, tuple] = {}
        """Op -> the shape its pieces were found by (``_lowered``)."""
        self.twins: dict[str, tuple[str, OpPieces, int]] = {}
        """``Lowered.twins``."""
        self._names: dict[str, tuple[str, ...]] = {}
        self.configs: tuple = ()
        self.position = {node.name: i for i, node in enumerate(graph)}
        self.by_op: dict[str, OpPieces] = {}
        self.partitions: dict[str, tuple[tuple[Partition, ...], ...]] = {}
        self.readers: dict[str, list[str]] | None = None
        """Weight -> the ops reading it, in graph order."""
        self.held: dict[str, Held] = {}
        self.totals: list = [[0] * n for _ in DeviceBytes._fields[:3]]
        self.totals += [np.zeros(n, dtype=np.int64) for _ in DeviceBytes._fields[3:]]  # weight bytes: numpy
        self.tensors = np.zeros(n, dtype=np.int64)

    def regroup(self, graph: OpGraph) -> None:
        self.readers = {}
        for node in graph:
            for name in self.by_op[node.name].weights_read:
                self.readers.setdefault(name, []).append(node.name)

    def hold(self, name: str, cache: dict) -> None:
        """Weight ``name``'s shards for its readers' current pieces, the totals patched."""
        read_by = tuple(self.by_op[op] for op in self.readers.get(name, ()))
        old = self.held.get(name)
        if old is not None and same_objects(old.read_by, read_by):
            return
        new = None
        if read_by:
            key = ("shards", name, self.copies, *map(id, read_by))
            new = cache.get(key)
            if new is None:
                new = cache[key] = (self._renamed(name, read_by, cache) or
                                    _weight_shards(name, read_by, len(self.tensors), self.copies))
        trainable, frozen = self.totals[3:]
        for h, sign in ((old, -1), (new, 1)):
            if h is None:
                continue
            total = trainable if h.shards[0].trainable else frozen
            total += sign * h.per_device
            self.tensors[h.holders] += sign
        if new is None:
            self.held.pop(name, None)
        else:
            self.held[name] = new


    def _renamed(self, name: str, read_by: tuple[OpPieces, ...], cache: dict) -> "Held | None":
        """The shards of weight ``name`` read by one op alone, as the shards of the weight in the same
        place of the op whose pieces its pieces rename (``_lowered``), renamed; None where it has
        other readers or its pieces are not a renaming."""
        if len(read_by) != 1:
            return None
        op = self.readers[name][0]
        twin = self.twins.get(op)
        if twin is None or twin[2]:  # moved: its shards lie on other devices
            return None
        first = cache.get(self.shaped[op])  # (the names of twin[0], its pieces twin[1])
        if first is None or first[1] is not twin[1]:  # that entry trimmed, or another op's since
            return None
        was = first[0][self.names(op).index(name)]
        key = ("shards", was, self.copies, id(twin[1]))
        got = cache.get(key)
        if got is None:
            got = cache[key] = _weight_shards(was, (twin[1],), len(self.tensors), self.copies)
        shards = [dataclasses.replace(s, name=name, ops=(op,)) for s in got.shards]  # one reader: ops (twin[0],)
        return Held(read_by, shards, got.per_device, got.holders)

    def names(self, op: str) -> tuple[str, ...]:
        """``names_of`` op, found once."""
        got = self._names.get(op)
        if got is None:
            got = self._names[op] = names_of(self.graph, self.graph[op])
        return got


def _patch(total: list[int], old: tuple[int, ...] | None, new: tuple[int, ...], at: list[int] | None = None) -> None:
    """total += new - old, per device (old None: nothing to take back); ``at``: only these
    devices' entries (the others are 0 in both: copy 0's lowering)."""
    if at is not None:
        for d in at:
            b = new[d] - (old[d] if old is not None else 0)
            if b:
                total[d] += b
        return
    if old is None:
        for d, b in enumerate(new):
            if b:
                total[d] += b
        return
    for d, (a, b) in enumerate(zip(old, new)):
        if a != b:
            total[d] += b - a


def _weight_shards(name: str, read_by: tuple[OpPieces, ...], n: int, copies: Copies | None = None) -> Held:
    """The shards of weight ``name`` read by ``read_by`` and what they add to the totals of the
    ``n`` devices; ``copies``: ``read_by`` are copy 0's, each region's holders their images in
    every copy too (``expand_holders``)."""
    held: dict[Box, set[int]] = {}
    ops: dict[str, None] = {}
    zero = 0  # the weight's sharding level: the largest of its reads' (tied weights: every reader's)
    for pieces in read_by:
        for read in pieces.weight_reads:
            if read.name == name:
                held.setdefault(read.region, set()).add(read.device)
                ops[read.op] = None
                zero = max(zero, read.zero)
                seen = read
    if copies is not None:
        held = expand_holders(held, copies)
    shards = weight_shards(name, held, seen.dtype, seen.trainable, tuple(ops), zero)
    per_device = np.zeros(n, dtype=np.int64)
    on = [s.devices.array() if isinstance(s.devices, Members) else np.fromiter(s.devices, np.int64, len(s.devices))
          for s in shards]
    for s, devices in zip(shards, on):
        per_device[devices] += s.nbytes  # a shard's devices are distinct
    holders = np.zeros(0, np.int64) if not seen.trainable else on[0] if len(on) == 1 else np.unique(np.concatenate(on))
    return Held(read_by, shards, per_device, holders)
