"""The weight-state terms of a device's memory (``simulator.memory``): its weights, gradients,
optimizer state and master copy, with sharded state (``strategies.zero``) counted as the ZeRO
paper does (Rajbhandari et al. 2020, §5, table 1: Ψ parameters, N replicas, K optimizer bytes
per parameter): level 1 keeps weights and gradients whole and K·Ψ/N of optimizer state (float32
master included in mixed precision); level 2 also keeps Ψ/N of gradients; level 3 also Ψ/N of
weights. Levels 2 and 3 work per use, and ``gathered_weights`` counts the most one use holds
besides: its gathered weights (level 3) and their full gradient before the reduce-scatter, and
the next use's weights prefetched meanwhile (``strategies.prefetch``)."""

from __future__ import annotations

from typing import NamedTuple

from strategies.lowering import Lowered
from strategies.prefetch import gathered_bytes
from strategies.zero import sharded_state

__all__ = ["StateBytes", "state_bytes"]


class StateBytes(NamedTuple):
    """One device's weight-state bytes."""

    weights: int
    """The trainable weights it keeps: level-3 shards as their chunk."""
    gradients: int
    optimizer_state: int
    master_weights: int
    gathered_weights: int
    """Levels 2 and 3: the most one use holds besides (``strategies.prefetch.gathered_bytes``)."""


def state_bytes(lowered: Lowered, state: int, master: int) -> list[StateBytes]:
    """Per device (``strategies.zero.ShardedState``): the trainable weights it keeps and its
    gradients (a level-3 shard's weight, a level-2 or level-3 shard's gradient as its chunk),
    ``state`` bytes of optimizer state per byte its optimizer updates (its chunks of sharded
    state, the rest whole) in the master's dtype (``master`` bytes per weight byte in mixed
    precision, 0 in the model's), the master copy (``master`` per updated byte in mixed
    precision; in the model's precision the working copies of its level-1 and level-2 chunks)
    and what one use holds besides (``strategies.prefetch.gathered_bytes``)."""
    ss, gathered = sharded_state(lowered), gathered_bytes(lowered)
    k = state * max(1, master)
    return [StateBytes(ss.weights[d], ss.gradients[d], k * ss.updated[d],
                       master * ss.updated[d] if master else ss.copies[d], gathered[d])
            for d in range(lowered.strategy.num_devices)]
