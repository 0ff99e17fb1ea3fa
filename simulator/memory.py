"""Per-device peak memory of a plan: weights + gradients + optimizer state + the activations
kept for backward of the micro-batches in flight."""

from __future__ import annotations

from strategies.lowering import Lowered
from strategies.schedule import warmups

__all__ = ["peak_memory", "OPTIMIZER_STATE"]

OPTIMIZER_STATE = {"sgd": 1, "adam": 2}
"""Optimizer state per trainable weight byte: SGD momentum one buffer, Adam two moments."""


def peak_memory(lowered: Lowered, optimizer: str = "sgd") -> list[int]:
    """Bytes per device: Σ held weight shards × (1 weight + 1 gradient + optimizer state) for
    trainable ones, plus, per micro-batch in flight, every output a partition on that device
    computes and every input region it receives from another device (both kept for backward)."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}")
    n = lowered.strategy.num_devices
    mem = [0] * n
    per = 2 + OPTIMIZER_STATE[optimizer]
    for s in lowered.weight_shards:
        for d in s.devices:
            mem[d] += s.nbytes * (per if s.trainable else 1)
    act = [0] * n
    for pieces in lowered.pieces.values():
        for d, nbytes in pieces.activations:
            act[d] += nbytes
    # a device holds the activations of the micro-batches it has warmed up (schedule.py)
    ws = warmups(lowered)
    return [mem[d] + ws.get(d, 0) * act[d] for d in range(n)]

