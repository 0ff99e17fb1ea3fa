"""Per-device peak memory of a plan: weights + gradients + optimizer state + the activations
kept for backward of the micro-batches in flight."""

from __future__ import annotations

from strategies.graph import DTYPE_BYTES
from strategies.lowering import Lowered
from strategies.region import box_numel

__all__ = ["peak_memory", "OPTIMIZER_STATE"]

OPTIMIZER_STATE = {"sgd": 1, "adam": 2}
"""Optimizer state per trainable weight byte: SGD momentum one buffer, Adam two moments."""


def _in_flight(lowered: Lowered) -> int:
    """Micro-batches whose activations a device holds at once: all of them under GPipe; under
    1F1B at most the pipeline depth (distinct device sets along the graph, bounded by m)."""
    m = lowered.strategy.microbatches
    if m == 1 or lowered.strategy.schedule == "gpipe":
        return m
    stages = len({lowered.strategy[n.name].devices for n in lowered.graph})
    return max(1, min(m, stages))


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
    graph = lowered.graph
    for node in graph:
        itemsize = DTYPE_BYTES[node.output.dtype]
        for p in lowered.partitions[node.name][0]:
            act[p.device] += itemsize * box_numel(p.box) if node.kind != "loss" else 8
    for t in lowered.transfers:
        if t.microbatch == 0 and not t.local:
            act[t.dst_device] += t.nbytes
    k = _in_flight(lowered)
    return [mem[d] + k * act[d] for d in range(n)]

