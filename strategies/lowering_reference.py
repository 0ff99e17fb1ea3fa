"""The lowering written plainly: every op's pieces derived afresh, every weight's shards and the
per-device totals summed over them, with no cache and nothing patched. It is what
``strategies.lowering.lower`` computes (that one patches the previous call's lowering where a
search's proposal changed a config); tests/strategies/test_lowering_reference.py checks that the
two give equal ``Lowered`` on random plans and walks of one-op changes."""

from __future__ import annotations

from strategies.graph import OpGraph
from strategies.lowered import (DeviceBytes, GradientSync, Lowered, OpPieces, WeightRead, WeightShard,
                                split_buckets, weight_shards)
from strategies.pieces import check_microbatches, lower_op
from strategies.precision import compute_graph
from strategies.region import Box
from strategies.strategy import Strategy
from strategies.zero import gather_uses

__all__ = ["lower_reference"]


def lower_reference(graph: OpGraph, strategy: Strategy) -> Lowered:
    """Everything ``strategy`` does on ``graph``, in four steps:

    1. each op's pieces (``strategies.pieces.lower_op``): its partitions, the transfers into
       them, its reduction groups and the weight regions its partitions read;
    2. each weight's shards: the regions its readers read, with the devices reading each
       (``_weight_shards``), weights in the order their first reader comes in the graph;
    3. the per-device byte totals (``DeviceBytes``): Σ over ops of what each keeps and receives,
       Σ over shards of what each device holds;
    4. the gradient sync (``GradientSync``): each bucket's bytes (``split_buckets`` at the
       plan's ``bucket_cap_mb``) and the trainable weights each device holds a shard of."""
    strategy.validate(graph)
    graph = compute_graph(graph, strategy.compute_dtype)  # mixed precision: float32 -> compute dtype
    m, n = strategy.microbatches, strategy.num_devices
    check_microbatches(graph, m)

    pieces: dict[str, OpPieces] = {node.name: lower_op(graph, strategy, node, m) for node in graph}

    reads: dict[str, list[WeightRead]] = {}  # weight -> its reads, in graph order
    for p in pieces.values():
        for name in p.weights_read:
            reads.setdefault(name, []).extend(r for r in p.weight_reads if r.name == name)
    shards = [s for name, rs in reads.items() for s in _weight_shards(name, rs)]

    kept, received, received_grad = [0] * n, [0] * n, [0] * n
    for p in pieces.values():
        for d in range(n):
            kept[d] += p.activations[d]
            received[d] += p.receives[0][d]
            received_grad[d] += p.receives[1][d]
    trainable, frozen = [0] * n, [0] * n
    for s in shards:
        for d in s.devices:
            (trainable if s.trainable else frozen)[d] += s.nbytes
    device_bytes = DeviceBytes(*map(tuple, (kept, received, received_grad, trainable, frozen)))

    buckets, of = split_buckets(shards, strategy.bucket_cap_bytes, strategy)
    tensors = [0] * n
    for name in reads:
        held_by = {d for s in shards if s.name == name and s.trainable for d in s.devices}
        for d in held_by:
            tensors[d] += 1

    lowered = Lowered(graph, strategy, {op: p.partitions for op, p in pieces.items()}, tuple(shards),
                      pieces, device_bytes, GradientSync(buckets, tuple(tensors), of))
    gather_uses(lowered)  # level 3 (FSDP): every use of a shard pairs up over its devices
    return lowered


def _weight_shards(name: str, reads: list[WeightRead]) -> list[WeightShard]:
    """The shards of weight ``name``: each region its ``reads`` read, held by the devices reading
    it, in the order first read (``weight_shards`` cuts partly overlapping regions into cells), at
    the largest sharding level of the ops reading it."""
    holders: dict[Box, set[int]] = {}
    for r in reads:
        holders.setdefault(r.region, set()).add(r.device)
    ops = tuple(dict.fromkeys(r.op for r in reads))
    return weight_shards(name, holders, reads[-1].dtype, reads[-1].trainable, ops, max(r.zero for r in reads))
