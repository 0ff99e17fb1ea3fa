"""Per-device peak memory of a plan: weights + gradients + optimizer state + the activations
kept for backward of the micro-batches in flight + the receive buffers the executor posts
ahead."""

from __future__ import annotations

from strategies.lowering import Lowered
from strategies.schedule import warmups

__all__ = ["peak_memory", "OPTIMIZER_STATE"]

OPTIMIZER_STATE = {"sgd": 1, "adam": 2}
"""Optimizer state per trainable weight byte: SGD momentum one buffer, Adam two moments."""


def peak_memory(lowered: Lowered, optimizer: str = "sgd") -> list[int]:
    """Bytes per device: Σ held weight shards × (1 weight + 1 gradient + optimizer state) for
    trainable ones, plus, per micro-batch in flight (w, ``schedule.warmups``), every output a
    partition on that device computes and every input region it receives from another device
    (both kept for backward), plus the receive buffers posted a micro-batch ahead
    (``soapsearch.executor.recipe.receives_ahead``): the forward pieces of one more micro-batch
    when w < m, and the gradient pieces of min(2, m) micro-batches."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}")
    n = lowered.strategy.num_devices
    per = 2 + OPTIMIZER_STATE[optimizer]
    trainable, frozen = lowered.weight_bytes
    pieces = lowered.pieces.values()
    act = list(map(sum, zip(*(p.activations for p in pieces))))
    fwd = list(map(sum, zip(*(p.receives[0] for p in pieces))))
    grad = list(map(sum, zip(*(p.receives[1] for p in pieces))))
    # a device holds the activations of the micro-batches it has warmed up (schedule.py)
    m = lowered.strategy.microbatches
    ws = warmups(lowered)
    return [trainable[d] * per + frozen[d] + ws.get(d, 0) * act[d] + (fwd[d] if ws.get(d, 0) < m else 0)
            + min(2, m) * grad[d] for d in range(n)]
