"""The ops reading each level-0 and level-1 gradient bucket's shards (``strategies.overlap``),
patched from one lowering's split to the next's.

A search's proposal changes a few ops: the weight shards of the others are the very objects of
the last lowering (``strategies.lowering_cache``) and only the shards of the changed weights
differ. DDP's greedy cut (``strategies.lowered.split_buckets``) may move every later bucket's
boundary, but a moved boundary moves only the shards between the old and the new cut to
another bucket. So ``BucketOps`` counts, per bucket, how many of its shards each op reads, and
from one call to the next takes out and puts back only the shards in the window where the
shard sequences differ (the common prefix and suffix found by identity) and those outside it
whose bucket changed; a bucket's op set is made again only where its counts changed. The
result equals ``bucket_ops`` of the same shards (tests/strategies/test_bucket_ops.py).
"""

from __future__ import annotations

import itertools
import operator
from typing import Iterator, Sequence

from strategies.lowered import BucketKey, WeightShard

__all__ = ["BucketOps", "bucket_ops"]

_COME = object()
"""The old bucket of a shard not in the old shards: unequal to every bucket and to None."""


def bucket_ops(shards: Sequence[WeightShard], of: Sequence[BucketKey | None]) -> dict[BucketKey, set[str]]:
    """Level-0 and level-1 bucket -> the ops reading its shards (``of``: each shard's bucket,
    ``GradientSync.shard_buckets``), from scratch."""
    ops: dict[BucketKey, set[str]] = {}
    for s, key in zip(shards, of):
        if key is not None and key.zero < 2:
            ops.setdefault(key, set()).update(s.ops)
    return ops


class BucketOps:
    """``bucket_ops`` of the last ``shards`` and ``of`` given, patched by ``update``."""

    def __init__(self) -> None:
        self.shards: Sequence[WeightShard] = ()
        self.of: Sequence[BucketKey | None] = ()
        self.counts: dict[BucketKey, dict[str, int]] = {}
        """Bucket -> op -> how many of the bucket's shards the op reads."""
        self.ops: dict[BucketKey, set[str]] = {}
        """Bucket -> its ops (``bucket_ops``); a set is replaced, never changed, when its
        counts change (``strategies.overlap._ready`` keeps the sets it was given)."""

    def update(self, shards: Sequence[WeightShard], of: Sequence[BucketKey | None]) -> dict[BucketKey, set[str]]:
        """``bucket_ops(shards, of)``, from the last call's by what differs."""
        old_s, old_of = self.shards, self.of
        touched: set[BucketKey] = set()
        for i, j in self._pairs(old_s, old_of, shards, of):  # old shard i is new shard j (-1: none)
            if i >= 0:
                self._count(old_of[i], old_s[i].ops, -1, touched)
            if j >= 0:
                self._count(of[j], shards[j].ops, 1, touched)
        ops = dict(self.ops)
        for key in touched:
            count = self.counts.get(key)
            if count:
                ops[key] = set(count)
            else:
                self.counts.pop(key, None)
                ops.pop(key, None)
        self.shards, self.of, self.ops = shards, of, ops
        return ops

    @staticmethod
    def _pairs(old_s, old_of, shards, of) -> Iterator[tuple[int, int]]:
        """(old position, new position) of each shard gone (new -1), come (old -1), or kept in
        another bucket, found by C-level passes: place by place where the counts are equal (a
        shard replaced in place is one gone and one come), else by the old shards' identities."""
        n_old, n_new = len(old_s), len(shards)
        if n_old == n_new:
            for i in itertools.compress(range(n_new), map(operator.is_not, old_s, shards)):
                yield i, -1
                yield -1, i
            yield from ((i, i) for i in itertools.compress(range(n_new), map(operator.ne, old_of, of))
                        if old_s[i] is shards[i])
            return
        where = dict(zip(map(id, old_s), range(n_old)))  # the old shards are alive: their ids are theirs
        at = list(map(where.get, map(id, shards), itertools.repeat(n_old, n_new)))  # n_old: not an old shard
        for i in set(range(n_old)).difference(at):
            yield i, -1
        was = (*old_of, _COME)
        for j in itertools.compress(range(n_new), map(operator.ne, map(was.__getitem__, at), of)):
            yield (-1 if at[j] == n_old else at[j]), j

    def _count(self, key: BucketKey | None, names: tuple[str, ...], sign: int, touched: set[BucketKey]) -> None:
        if key is None or key.zero >= 2:
            return
        count = self.counts.setdefault(key, {})
        for name in names:
            c = count.get(name, 0) + sign
            if c:
                count[name] = c
            else:
                del count[name]
        touched.add(key)
