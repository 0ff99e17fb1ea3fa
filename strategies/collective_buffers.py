"""How long what a collective leaves a member lives, per micro-batch: the one rule the memory
model (``simulator.memory_walks``) walks and the executor (``soapsearch.executor``) frees by.

A member calls collective c at the start of its first reader op's forward step
(``strategies.schedule.collective_steps``). What the call leaves it (``Collective.result``):

- is *gathered again* where it is an all-gather and every reader op recomputes, or is a linear
  and the all-gather is along the sequence (``REGATHERED``, ``sequence_gather``; sequence
  parallelism's gathered input to a recomputed layer or to a column-parallel linear;
  Korthikanti et al. 2022 §4.2.2: Megatron-LM keeps the shard and
  gathers again in the backward; its ``LinearWithGradAccumulationAndAsyncCommunication``,
  ``megatron/core/tensor_parallel/layers.py``, saves the shard with ``save_for_backward(input,
  weight)``, all-gathers into a buffer for the forward product and all-gathers again in the
  backward for the weight gradient): it lives until the forward step of the last reader op,
  and each member calls the all-gather again at the backward step where its first reader is
  recomputed, or where a linear reader that does not recompute runs its backward first (the
  last in graph order) (``regather``), the result living until the backward step of the first
  reader op in graph order (the last of them to run backward);
- is *called again* likewise where its producer drops its output (``drops_output``) and every
  reader op recomputes: the recomputation reruns the producer, the collective and the readers,
  as checkpointing the block does (Megatron-LM's full recompute, ``CheckpointFunction``;
  Korthikanti et al. 2022 §4.1: the row-parallel linears' reductions of partial sums run again);
- else is *kept* for the backward where some reader op reads it back (``strategies.drops.reads_back``:
  autograd saves it) or recomputes (its recomputation reads it again): then it lives until the
  backward step of the first reader op in graph order;
- else it is transient, as a row-parallel linear's reduce-scattered sum read by a dropout: it
  lives until the forward step of the last reader op in graph order.

Where the gradient moves (``Collective.grad``), each reader partition on the member leaves its
input's gradient (one buffer of the result's size a reader) from its own backward step to the
end of the holder's backward step, at whose start the member calls the dual with their sum
(DDP and Megatron-LM free a collective's gradient buffer once its reduction ends; Li et al.,
VLDB 2020). Inside that step the dual's result is the holder's output gradient, which, as any
op's output gradient, is not counted.

A level-0 or level-1 gradient bucket (``strategies.overlap``) is a flat tensor of its own: each
member packs the bucket's gradients into it, in the plan's reduce dtype
(``strategies.precision.reduce_dtype``), right after the backward step that
``strategies.overlap.bucket_issues`` names, and holds it until the step's gradient sync has
waited its collective and copied the sum back (``soapsearch.executor.shards``: ``start_bucket``,
``sync_grads``; DDP keeps its bucket buffers so too). ``bucket_buffers`` gives its bytes."""

from __future__ import annotations

from typing import NamedTuple

from strategies.lowered import BucketKey, Collective, Lowered
from strategies.memo import per_lowered
from strategies.drops import drop_positions, drops_output, reads_back
from strategies.precision import reduce_scale
from strategies.schedule import Step
from strategies.zero import zero_buckets

__all__ = ["BufferLife", "BufferLives", "buffer_lives", "regather_steps", "bucket_buffers", "REGATHERED",
           "sequence_gather"]

REGATHERED = ("linear",)
"""Op kinds that keep a sequence-parallel all-gather's shard rather than its result where they
do not recompute, gathering again in their backward (``sequence_gather``): Megatron-LM's
column-parallel linear under sequence parallelism (``LinearWithGradAccumulationAndAsyncCommunication``:
``ctx.save_for_backward(input, weight)`` of the shard; Korthikanti et al. 2022 §4.2.2, whose eq. 6
counts the linears' inputs at sbh/t). An all-gather of the samples or of the features a linear
contracts (Krizhevsky's one weird trick) stays what autograd saves.

A known gap (time, not memory): where such a linear recomputes (full recompute with sequence
parallelism), Megatron-LM all-gathers twice in the backward, once in the checkpoint's recomputed
forward and once more in the linear's own backward beside ``grad_output.matmul(weight)``; the
model (``simulator.collectives``) and the executor call it again once, at the recompute step. No
published row (``benchmarks.published_data.ROWS``) has full recompute with sequence parallelism."""


def sequence_gather(graph, c: Collective) -> bool:
    """``c`` is an all-gather along a dim that is neither the samples nor the last (the features
    a linear contracts): sequence parallelism's, the tokens' dim. The rule is by position only:
    any dim but the samples and the contracted one counts (a channel or heads dim read directly
    by a linear would too; no zoo model gathers one)."""
    node = graph[c.op]
    return c.kind == "all_gather" and node.dims[c.dim].role != "sample" and c.dim != len(node.output.shape) - 1


class BufferLife(NamedTuple):
    """Where collective c's buffers live on each member, per micro-batch (ops by name)."""

    collective: Collective
    first: str
    """The first reader op in graph order: the call is at the start of its forward step; if
    ``kept``, or gathered again (``regather``), the result is freed after its backward step."""
    last: str
    """The last reader op in graph order: if not ``kept``, the result is freed after its forward
    step; where the gradient moves, the first reader gradient appears at its backward step."""
    kept: bool
    """Kept from the call to the backward: some reader op reads the result back in its backward
    or recomputes, and it is not called again."""
    readers: tuple[tuple[str, int], ...]
    """(reader op, its partitions on each member): each leaves a gradient of the result's size
    from its backward step to the end of the holder's (``Collective.op``); empty where the
    gradient does not move."""
    regather: str | None = None
    """The op at whose first backward step each member calls the collective again (an all-gather
    whose first reader is recomputed or a linear reader runs its backward first, or a reduction
    whose producer drops its output); None: called once."""


def buffer_lives(lowered: Lowered, microbatch: int | None = None) -> tuple[BufferLife, ...]:
    """The ``BufferLife`` of each of ``Lowered.collectives`` (of ``microbatch`` only, where
    given: every micro-batch's are alike), in that order. Every member runs a reader partition
    of every reader op (``strategies.collectives``), as many on each."""
    life = BufferLives(lowered)
    return tuple([life(c) for c in lowered.collectives if microbatch is None or c.microbatch == microbatch])


class BufferLives:
    """``buffer_lives`` one collective at a time (``life(c)``), what it reads of the plan found
    once for all: each op's position, each (reader, producer)'s read back, where each dropped
    recompute op is recomputed."""

    def __init__(self, lowered: Lowered) -> None:
        self.lowered = lowered
        self.position: dict[str, int] = {}
        self.back: dict[tuple[str, str], bool] = {}  # (reader op, producer) -> it reads the result again after its forward
        self.again: dict[str, int | None] | None = None  # recompute reader op -> where it is recomputed (None: not one step)

    def __call__(self, c: Collective) -> BufferLife:
        lowered, position, back = self.lowered, self.position, self.back
        graph, strategy = lowered.graph, lowered.strategy
        if not position:
            position.update({node.name: i for i, node in enumerate(graph)})
        reads = lowered.collective_readers[c]
        on = reads[0].device
        count: dict[str, int] = {}
        for r in reads:
            if r.device == on:
                count[r.dst_op] = count.get(r.dst_op, 0) + 1
        ops = sorted(count, key=position.__getitem__)
        for u in ops:
            if (u, c.op) not in back:
                back[u, c.op] = strategy[u].recompute or reads_back(graph, strategy, u, c.op)
        regather = None
        plain = [u for u in ops if not strategy[u].recompute]  # readers that must be linears of a sequence gather
        # called again: a gather re-read by recomputations or linears; a dropped output's, read by recomputations only
        if (c.kind == "all_gather" and all(graph[u].kind in REGATHERED for u in plain) and (
                not plain or sequence_gather(graph, c))) or (not plain and drops_output(graph, strategy, c.op)):
            if self.again is None:
                self.again = _recomputed_at(lowered, position)
            at = [self.again.get(u, position[u]) for u in ops]
            if None not in at:
                regather = graph.nodes[max(at)].name
        return BufferLife(c, ops[0], ops[-1], regather is None and any(back[u, c.op] for u in ops),
                          tuple((u, count[u]) for u in ops) if c.grad else (), regather)


@per_lowered
def _recomputed_at(lowered: Lowered, position: dict[str, int]) -> dict[str, int | None]:
    """Dropped recompute op -> the position of the op at whose backward step it is recomputed on
    every device (``strategies.drops.drop_positions``; None where devices differ). A recompute
    op that keeps its output is recomputed at its own step (not listed). Found once per lowering:
    the task graph's collectives and the memory model's rows both ask."""
    strategy = lowered.strategy
    return {op: groups[0][2] if len(groups) == 1 else None
            for op, groups in drop_positions(lowered.graph, strategy, position).items() if strategy[op].recompute}


def regather_steps(lowered: Lowered, life: BufferLife) -> dict[int, Step]:
    """Member -> the step at whose start it calls ``life``'s collective again: its first backward
    step of ``life.regather`` (the op's last partition there), where it is called again at its
    backward (recomputed, or a linear's own backward)."""
    c, op = life.collective, life.regather
    last: dict[int, int] = {}  # device -> its last partition of op
    for p in lowered.partitions[op][c.microbatch]:
        last[p.device] = max(last.get(p.device, p.index), p.index)
    kept = None if lowered.copies is None else lowered.copies.kept  # a folded lowering's devices
    missing = [d for d in c.devices if d not in last and (kept is None or d in kept)]
    if missing:
        raise ValueError(f"op {op!r}: device {missing[0]} is a member of the {c.kind} of {c.op!r} "
                         f"(micro-batch {c.microbatch}) called again at its backward but holds no "
                         f"partition of {op!r} (its partitions are on devices {sorted(last)})")
    return {d: Step(True, op, last[d], c.microbatch) for d in c.devices if d in last}


def bucket_buffers(lowered: Lowered) -> dict[BucketKey, int]:
    """Level-0 and level-1 gradient bucket -> the bytes each member holds of it from its issue to
    the step's sync, in the reduce dtype (``reduce_scale`` × the bucket's bytes): level 0 its
    flat tensor of the bucket's gradients; level 1 that tensor padded to n chunks
    (``strategies.zero``) and the member's chunk of the sum, n + 1 chunks. The loss sums riding
    a level-0 bucket (``strategies.lowering.bucket_sums``: a few scalars) aside."""
    sharded = zero_buckets(lowered)
    out = {}
    for key, nbytes in lowered.gradient_sync.buckets.items():
        if key.zero > 1:
            continue
        wide, zb = reduce_scale(lowered.strategy, key.dtype), sharded.get(key)
        out[key] = nbytes * wide if zb is None else zb.chunk_bytes * wide * (len(key.devices) + 1)
    return out
