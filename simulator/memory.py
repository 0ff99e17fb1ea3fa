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
    when w < m, and the gradient pieces of min(2, m) micro-batches; plus the collectives'
    buffers (``Lowered.collective_bytes``): what each call leaves a member, kept for backward
    per micro-batch in flight like a received piece, and one micro-batch's gradient buffers."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}")
    n = lowered.strategy.num_devices
    per = 2 + OPTIMIZER_STATE[optimizer]
    b = lowered.device_bytes
    # a device holds the activations of the micro-batches it has warmed up (schedule.py)
    m = lowered.strategy.microbatches
    ws = warmups(lowered)
    gathered, grads = lowered.collective_bytes()
    return [b.trainable[d] * per + b.frozen[d] + ws.get(d, 0) * (b.kept[d] + gathered[d])
            + (b.received[d] if ws.get(d, 0) < m else 0) + min(2, m) * b.received_grad[d] + grads[d]
            for d in range(n)]
