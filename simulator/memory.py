"""Per-device peak memory of a plan: weights + gradients + optimizer state + the activations
kept for backward of the micro-batches in flight + the receive buffers the executor posts
ahead + the collectives' buffers + the gradient buckets' flat tensors. ``peak_memory`` gives
the figure (the search scores every proposal with it); ``memory_breakdown`` the same figure by
category, for reports."""

from __future__ import annotations

from typing import NamedTuple

from simulator.memory_walks import Walks, activation_peaks, device_warmups
from simulator.memory_zero import state_bytes
from strategies.lowering import Lowered

__all__ = ["peak_memory", "memory_breakdown", "MemoryBreakdown", "OPTIMIZER_STATE", "activation_peaks"]

OPTIMIZER_STATE = {"sgd": 1, "adam": 2}
"""Optimizer state per trainable weight byte: SGD momentum one buffer, Adam two moments."""


class MemoryBreakdown(NamedTuple):
    """One device's peak by category, in bytes; the fields sum to its ``peak_memory`` figure
    (``total``)."""

    weights: int
    """The weight shards held, trainable and frozen."""
    gradients: int
    """One gradient byte per trainable weight byte."""
    optimizer_state: int
    """``OPTIMIZER_STATE`` bytes per trainable weight byte the device updates (SGD momentum;
    Adam's two moments); in mixed precision per float32 master byte. A sharded bucket
    (``zero`` ≥ 1) counts its chunk only (``strategies.zero``)."""
    activations: int
    """The peak over the device's run order (``activation_peaks``) of what its partitions
    keep for backward per micro-batch in flight (the outputs they compute, the input regions
    they receive from other devices) and of recompute's dropped outputs while they live."""
    receive_buffers: int
    """The forward pieces of one more micro-batch (when not all are in flight) and the gradient
    pieces of min(2, m) micro-batches, posted ahead."""
    collective_buffers: int
    """What the collectives' buffers add to the activations' peak: each call's result, kept per
    micro-batch in flight where a reader reads it back or recomputes, else until its last
    reader's forward, and its readers' gradients from their backward to the dual's
    (``strategies.collective_buffers``, walked with the activations)."""
    master_weights: int = 0
    """Mixed precision: the float32 master copy of what the device updates (``MASTER`` bytes
    per compute-dtype weight byte, a sharded bucket's chunk only). "model" precision: the
    working copy of its sharded buckets' chunks (0 with none)."""
    gathered_weights: int = 0
    """Levels 2 and 3 (``zero``, per use): the most one use holds besides, its level-3 shards
    gathered and the full gradient of its shards before their reduce-scatter."""
    gradient_buckets: int = 0
    """What the level-0/1 gradient buckets' flat tensors add to the activations' peak (with the
    collectives' buffers): each held from its issue in the last backward pass to the step's
    sync, in the reduce dtype (``strategies.collective_buffers.bucket_buffers``)."""

    @property
    def total(self) -> int:
        return sum(self)

    def largest(self, k: int = 3) -> list[tuple[str, int]]:
        """The ``k`` largest non-zero categories, (name, bytes), largest first (ties in field
        order)."""
        items = sorted(((n, b) for n, b in zip(self._fields, self) if b), key=lambda x: -x[1])
        return items[:k]

    def describe(self, k: int = 3) -> str:
        """One short line: the peak and its ``k`` largest categories, in GiB (MiB or KiB where
        the peak is under 1 GiB or 1 MiB): ``peak 1.23 GiB: activations 0.8, optimizer state
        0.2, weights 0.1 GiB``."""
        total = self.total
        unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20)) if total >= s), ("KiB", 2**10))
        parts = ", ".join(f"{n.replace('_', ' ')} {b / scale:.3g}" for n, b in self.largest(k))
        return f"peak {total / scale:.3g} {unit}" + (f": {parts} {unit}" if parts else "")

    def to_json(self) -> dict[str, int]:
        return dict(zip(self._fields, self))


MASTER = 2
"""Float32 master bytes per compute-dtype (bf16/fp16) weight byte in mixed precision."""


def _master(lowered: Lowered) -> int:
    """Master bytes per trainable weight byte: 0 in "model" precision, ``MASTER`` in mixed
    (the lowering's weights are then in the compute dtype, ``strategies.precision``)."""
    return 0 if lowered.strategy.precision == "model" else MASTER


def _check(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}")
    return OPTIMIZER_STATE[optimizer]


def peak_memory(lowered: Lowered, optimizer: str = "sgd") -> list[int]:
    """Bytes per device: Σ held weight shards × (1 weight + 1 gradient + optimizer state) for
    trainable ones, plus the peak of the activations over its run order
    (``activation_peaks``: per micro-batch in flight, w = ``schedule.warmups``, every output a
    partition on that device computes and every input region it receives from another device,
    both kept for backward, and recompute's dropped outputs while they live), plus the receive
    buffers posted a micro-batch ahead (``soapsearch.executor.recipe.receives_ahead``): the
    forward pieces of one more micro-batch when w < m, and the gradient pieces of min(2, m)
    micro-batches; the collectives' buffers are in the same walk (``simulator.memory_collectives``:
    what each call leaves a member, kept per micro-batch in flight or let go after its last
    reader's forward, and its readers' gradients from their backward to the dual's), and so
    are the level-0/1 gradient buckets' flat tensors, each from its issue in the last backward
    pass to the step's sync (``strategies.collective_buffers.bucket_buffers``).
    In mixed precision the weights and gradients held are the compute dtype's (2 bytes a
    parameter) and a float32 master copy and the optimizer state in float32 are added: ZeRO's
    2 + 2 + 12 = 16 bytes a parameter with Adam, 2 + 2 + 4 + 4 with SGD's momentum
    (Rajbhandari et al. 2020, section 3.1). Sharded gradient buckets (``ParallelConfig.zero``)
    keep optimizer state and master for their chunk only (``simulator.memory_zero``). The sum
    of ``memory_breakdown``'s categories, without building them."""
    state = state_bytes(lowered, _check(optimizer), _master(lowered))
    n = lowered.strategy.num_devices
    b = lowered.device_bytes
    # a device holds the activations of the micro-batches it has warmed up (schedule.py)
    m = lowered.strategy.microbatches
    ws = device_warmups(lowered)
    acts = activation_peaks(lowered, ws)
    return [sum(state[d]) + b.frozen[d] + acts[d]
            + (b.received[d] if ws.get(d, 0) < m else 0) + min(2, m) * b.received_grad[d]
            for d in range(n)]


def memory_breakdown(lowered: Lowered, optimizer: str = "sgd") -> list[MemoryBreakdown]:
    """``peak_memory``'s figure per device by category: each device's fields sum to it. The
    activations are their walk's peak without the collectives; ``collective_buffers`` what the
    collectives' buffers add to it (``activation_peaks`` with them, less without), and
    ``gradient_buckets`` what the buckets' flat tensors add to that."""
    state = state_bytes(lowered, _check(optimizer), _master(lowered))
    n = lowered.strategy.num_devices
    b = lowered.device_bytes
    m = lowered.strategy.microbatches
    ws = device_warmups(lowered)
    walks = Walks(lowered, ws)  # the three walks share their rows (not under the interleaved schedule)
    acts = walks.peaks(False, False)
    both = walks.peaks(True, False) if lowered.collectives else acts
    full = walks.peaks(True, True)
    out = []
    for d in range(n):
        w = ws.get(d, 0)
        out.append(MemoryBreakdown(
            weights=state[d].weights + b.frozen[d], gradients=state[d].gradients,
            optimizer_state=state[d].optimizer_state, activations=acts[d],
            receive_buffers=(b.received[d] if w < m else 0) + min(2, m) * b.received_grad[d],
            collective_buffers=both[d] - acts[d], master_weights=state[d].master_weights,
            gathered_weights=state[d].gathered_weights, gradient_buckets=full[d] - both[d]))
    return out
