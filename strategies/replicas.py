"""How many devices hold each weight shard an op reads: the replica group a sharding level
(``ParallelConfig.zero``) shards the shard's state over. A level on an op whose shards have one
replica is a no-op (``strategies.config.ZERO_LEVELS``); the ``fsdp``/``zero1`` baselines and the
search's sharding-level move skip such ops."""

from __future__ import annotations

import math

from strategies.graph import OpGraph, OpNode
from strategies.lowered import WEIGHT_KINDS
from strategies.pieces import partition_box_mb
from strategies.rules import get_rule
from strategies.strategy import Strategy

__all__ = ["shardable", "weight_replicas"]


def _own_replicas(node: OpNode, degrees: tuple[int, ...]) -> int:
    """The most partitions of ``node`` under ``degrees`` that read the same weight regions."""
    rule = get_rule(node.kind)
    groups: dict[tuple, int] = {}
    for k in range(math.prod(degrees)):
        ws = rule.weight_regions(node, partition_box_mb(node, degrees, k, 0, 1))
        key = tuple(sorted(ws.items()))
        groups[key] = groups.get(key, 0) + 1
    return max(groups.values(), default=1)


def weight_replicas(graph: OpGraph, plan: Strategy, op: str) -> int:
    """The largest replica group of ``op``'s trainable weight shards under ``plan``: for an op
    that reads its own weights, its partitions reading the same regions (each on its own
    device); for a parameter op (a weight its consumers read, e.g. a tied embedding), the
    devices its consumers run on. 0 where the op has no trainable weight."""
    node = graph[op]
    if not any(w.trainable for w in node.weights):
        return 0
    if node.kind in WEIGHT_KINDS:
        return len({d for user in graph.users(op) for d in plan[user].devices}) or 1
    return _own_replicas(node, plan[op].degrees)


def shardable(graph: OpGraph, plan: Strategy, op: str) -> bool:
    """Whether a sharding level changes anything for ``op`` under ``plan``: it has a trainable
    weight whose shards have two replicas or more."""
    return weight_replicas(graph, plan, op) > 1
