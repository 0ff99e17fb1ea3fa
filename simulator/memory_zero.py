"""The weight-state terms of a device's memory (``simulator.memory``): its gradients, optimizer
state and master copy, with sharded gradient buckets (``strategies.zero``) counted as the ZeRO
paper does (Rajbhandari et al. 2020, §5, table 1: Ψ parameters, N replicas, K optimizer bytes
per parameter): level 1 keeps weights and gradients whole and K·Ψ/N of optimizer state (float32
master included in mixed precision); level 2 is level 1 with the summed gradient kept as the
Ψ/N chunk after the step (the full gradient is still accumulated during the backward pass,
whose reduce-scatter runs at the step end, so the peak counts it whole); level 3 keeps Ψ/N of
weights and of gradients too, plus the shards one use gathers (``gathered_weights``)."""

from __future__ import annotations

from typing import NamedTuple

from strategies.lowering import Lowered
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
    """Level 3: the largest set of shards one use gathers, twice (the gathered weights, and in
    the backward their full gradient before its reduce-scatter)."""


def state_bytes(lowered: Lowered, state: int, master: int) -> list[StateBytes]:
    """Per device: the trainable weights it keeps and their gradients (one byte per weight
    byte; a level-3 shard's chunk), ``state`` bytes of optimizer
    state per byte the device's optimizer updates (``ShardedState.updated``: its chunk of each
    sharded bucket, the rest whole) in the master's dtype (``master`` bytes per weight byte in
    mixed precision, 0 in the model's), and the master copy: ``master`` per updated byte in
    mixed precision; in the model's precision the working copy of its chunks (the flat tensor
    the optimizer updates before the all-gather)."""
    ss = sharded_state(lowered)
    trainable = lowered.device_bytes.trainable
    k = state * max(1, master)
    return [StateBytes(trainable[d] - ss.sharded3[d] + ss.held3[d], trainable[d] - ss.sharded3[d] + ss.held3[d],
                       k * ss.updated[d], master * ss.updated[d] if master else ss.chunks[d], 2 * ss.gathered[d])
            for d in range(lowered.strategy.num_devices)]
