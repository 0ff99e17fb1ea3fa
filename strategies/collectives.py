"""Which reads of a producer's output are collectives (``Collective``) rather than point-to-point
pieces: a function of the producer's config, the consumer's partitions and their input regions,
called by ``strategies.pieces.lower_op`` for each input and micro-batch.

The consumer's partitions reading one input are grouped by the producer partitions they read
from (the *holders*). A group is a collective over the holders' devices G (sorted, each device
once, at least two) when every device of G runs a reader of it, no reader runs elsewhere, and:

- **all_reduce**: the holders hold Partial sums of one region R (the producer's reduction dims
  are cut) and every reader reads all of R;
- **reduce_scatter**: the holders hold Partial sums of R and the reader on G[i] reads chunk i of
  R along one dim (R cut in |G| equal chunks; torch's ``reduce_scatter_tensor`` gives group
  rank i chunk i, so another order stays point-to-point): sequence parallelism after a
  row-parallel linear (Korthikanti et al. 2022);
- **all_gather**: the holder on G[i] holds chunk i of R along one dim (a Shard) and every reader
  reads all of R: a column-parallel linear reading a sequence-cut LayerNorm.

Anything else moves as point-to-point pieces. The ``Collective`` record names the producer, the
micro-batch, G, R and the dim, not the consumer: equal records from several consumer ops (the
q, k and v linears reading one LayerNorm) are one collective (``Lowered.collectives``).
"""

from __future__ import annotations

from typing import Sequence

from strategies.graph import DTYPE_BYTES, OpNode
from strategies.lowered import Collective
from strategies.region import Box, box_numel, partition_index

__all__ = ["find_collectives"]


def _held(grid: Sequence[tuple[int, int]], degrees: Sequence[int], q: int, ndim: int) -> Box:
    """The output region producer partition ``q`` holds (its box's first ``ndim`` dims)."""
    return tuple((b + c * st, b + (c + 1) * st)
                 for (b, st), c in zip(grid[:ndim], partition_index(q, degrees)[:ndim]))


def _chunk_dim(region: Box, chunks: Sequence[Box]) -> int | None:
    """The dim along which ``chunks`` are ``region`` cut in len(chunks) equal, ordered chunks
    (chunk i the i-th), or None when they are not."""
    n = len(chunks)
    differ = {i for c in chunks for i, (a, b) in enumerate(zip(c, region)) if a != b}
    if len(differ) != 1:
        return None
    dim = differ.pop()
    lo, hi = region[dim]
    if (hi - lo) % n:
        return None
    w = (hi - lo) // n
    for i, c in enumerate(chunks):
        if c != region[:dim] + ((lo + i * w, lo + (i + 1) * w),) + region[dim + 1:]:
            return None
    return dim


def find_collectives(producer: OpNode, devices: Sequence[int], degrees: Sequence[int],
                     grid: Sequence[tuple[int, int]], partial: bool, microbatch: int, grad: bool,
                     reads: Sequence[tuple[int, int, Box, tuple[int, ...]]]) -> dict[int, Collective]:
    """Reader partition index -> the collective it reads its input from (module docstring).
    ``devices``, ``degrees``, ``grid``: the producer's config and its grid in ``microbatch``
    (``strategies.pieces.grid_of``); ``partial``: its reduction dims are cut; ``grad``: the
    gradient moves back (``OpGraph.moves_grad``); ``reads``: (partition index, device, input
    region, the holders it overlaps in partition order) of each reader of this input."""
    groups: dict[tuple[int, ...], list[tuple[int, int, Box]]] = {}
    for k, dev, region, holders in reads:
        if len(holders) > 1:
            groups.setdefault(holders, []).append((k, dev, region))
    out: dict[int, Collective] = {}
    ndim = len(producer.output.shape)
    for holders, readers in groups.items():
        on = {devices[q]: q for q in holders}
        if len(on) != len(holders) or {dev for _, dev, _ in readers} != set(on):
            continue  # a device holds two pieces, or a member reads nothing / a reader is outside
        group = tuple(sorted(on))
        ordered = tuple(on[d] for d in group)
        held = [_held(grid, degrees, q, ndim) for q in ordered]
        if partial:
            region = held[0]
            if any(h != region for h in held):
                continue
            if all(r == region for _, _, r in readers):
                kind, dim = "all_reduce", None
            else:
                kind = "reduce_scatter"
                chunks = {dev: r for _, dev, r in readers}
                if len(chunks) != len(group) or any(r != chunks[dev] for _, dev, r in readers):
                    continue  # two readers on one device read different chunks
                dim = _chunk_dim(region, [chunks[d] for d in group])
                if dim is None:
                    continue
        else:
            region = tuple((min(h[i][0] for h in held), max(h[i][1] for h in held)) for i in range(ndim))
            if any(r != region for _, _, r in readers):
                continue
            kind, dim = "all_gather", _chunk_dim(region, held)
            if dim is None:
                continue
        c = Collective(kind, producer.name, microbatch, group, ordered, region, dim,
                       box_numel(region) * DTYPE_BYTES[producer.output.dtype], grad)
        for k, _, _ in readers:
            out[k] = c
    return out
