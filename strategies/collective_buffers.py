"""How long what a collective leaves a member lives, per micro-batch: the one rule the memory
model (``simulator.memory``) walks and the executor (``soapsearch.executor``) frees by.

A member calls collective c at the start of its first reader op's forward step
(``strategies.schedule.collective_steps``). What the call leaves it (``Collective.result``):

- is *kept* for the backward where some reader op reads it back (``strategies.pieces.reads_back``:
  autograd saves it) or recomputes (its recomputation reads it again): then it lives until the
  backward step of the first reader op in graph order (the last of them to run backward);
- else it is transient, as a row-parallel linear's reduce-scattered sum read by a dropout: it
  lives until the forward step of the last reader op in graph order.

Where the gradient moves (``Collective.grad``), each reader partition on the member leaves its
input's gradient (one buffer of the result's size a reader) from its own backward step to the
end of the holder's backward step, at whose start the member calls the dual with their sum
(DDP and Megatron-LM free a collective's gradient buffer once its reduction ends; Li et al.,
VLDB 2020). Inside that step the dual's result is the holder's output gradient, which, as any
op's output gradient, is not counted."""

from __future__ import annotations

from typing import NamedTuple

from strategies.lowered import Collective, Lowered
from strategies.pieces import reads_back

__all__ = ["BufferLife", "buffer_lives"]


class BufferLife(NamedTuple):
    """Where collective c's buffers live on each member, per micro-batch (ops by name)."""

    collective: Collective
    first: str
    """The first reader op in graph order: the call is at the start of its forward step; if
    ``kept``, the result is freed after its backward step."""
    last: str
    """The last reader op in graph order: if not ``kept``, the result is freed after its forward
    step; where the gradient moves, the first reader gradient appears at its backward step."""
    kept: bool
    """Some reader op reads the result back in its backward or recomputes."""
    readers: tuple[tuple[str, int], ...]
    """(reader op, its partitions on each member): each leaves a gradient of the result's size
    from its backward step to the end of the holder's (``Collective.op``); empty where the
    gradient does not move."""


def buffer_lives(lowered: Lowered, microbatch: int | None = None) -> tuple[BufferLife, ...]:
    """The ``BufferLife`` of each of ``Lowered.collectives`` (of ``microbatch`` only, where
    given: every micro-batch's are alike), in that order. Every member runs a reader partition
    of every reader op (``strategies.collectives``), as many on each."""
    graph, strategy, readers = lowered.graph, lowered.strategy, lowered.collective_readers
    position: dict[str, int] = {}
    back: dict[str, bool] = {}  # reader op -> it reads the result again after its forward
    out = []
    for c in lowered.collectives:
        if microbatch is not None and c.microbatch != microbatch:
            continue
        if not position:
            position = {node.name: i for i, node in enumerate(graph)}
        reads = readers[c]
        on = reads[0].device
        count: dict[str, int] = {}
        for r in reads:
            if r.device == on:
                count[r.dst_op] = count.get(r.dst_op, 0) + 1
        ops = sorted(count, key=position.__getitem__)
        for u in ops:
            if u not in back:
                back[u] = strategy[u].recompute or reads_back(graph, strategy, u)
        out.append(BufferLife(c, ops[0], ops[-1], any(back[u] for u in ops),
                              tuple((u, count[u]) for u in ops) if c.grad else ()))
    return tuple(out)
