"""Level-2 and level-3 weights on one rank (``ParallelConfig.zero``; ``strategies.zero``): the
rank keeps its chunk of each such shard (``chunks``, the tensors the optimizer updates), and
after each backward of a partition reading one it reduce-scatters the shard's gradient into the
chunk's (started there, waited at the step end) and frees the full gradient. Level 2 (FSDP's
``SHARD_GRAD_OP``) keeps the weight whole and all-gathers the updated chunks into it after the
step (``gather_chunks``). Level 3 (FSDP2's ``fully_shard``) keeps only the chunk: before the
forward of a reader partition it all-gathers the shard into the weight's leaf (whose storage
is otherwise freed: the leaf keeps its shape, and the views the recipes and autograd's saved
tensors hold see the gathered values again), frees it after (reshard after forward), and
gathers it again before the backward. A use's shards on one device set are one group
(``strategies.zero.GatherGroup``, FSDP2's ``FSDPParamGroup``): one all-gather of the
concatenated chunks per phase, one reduce-scatter of the gradients laid out the same way. Calls
go on process groups of their own, in each member's step order
(``strategies.zero.gather_groups``), so they pair up with no other call. A level-3 all-gather is
started ahead (``start``, async, at the step ``strategies.prefetch`` names, FSDP2's prefetch)
and waited in ``unshard`` right before its reader computes; under ``fsdp_unit`` "block" one call
gathers a unit's groups on one device set (``strategies.prefetch.calls_at``)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import ProcessGroups, run_collective
from strategies.lowered import WeightShard
from strategies.precision import reduce_dtype
from strategies.strategy import Strategy
from strategies.region import box_numel, slice_box
from strategies.zero import GatherGroup, chunk_numel, chunk_span, gather_groups, per_use_shards

__all__ = ["GatheredWeights"]


def _wire(t: torch.Tensor, shard: WeightShard, strategy: Strategy | None = None) -> torch.Tensor:
    """``t`` in the dtype its collective moves it in: the shard's in the lowering (a mixed
    precision plan's compute dtype, FSDP2's param_dtype; the chunks and leaves stay float32
    masters), or with ``strategy`` a gradient's, the plan's reduce dtype (FSDP2's reduce_dtype,
    ``strategies.precision.reduce_dtype``)."""
    dtype = shard.dtype if strategy is None else reduce_dtype(strategy, shard.dtype)
    return t.to(getattr(torch, dtype))


class GatheredWeights:
    """This rank's level-2 and level-3 shards of ``lowered``; ``tensors``, ``index``: its
    ``LocalWeights``' leaves and view rule (the leaves of level-3 weights have their storage
    freed here)."""

    def __init__(self, lowered, rank: int, tensors: dict[str, torch.Tensor], index, state) -> None:
        self.rank, self.tensors, self.index = rank, tensors, index
        self.strategy = lowered.strategy
        shards = per_use_shards(lowered)
        self.groups = ProcessGroups([s.devices for s in shards], lowered.strategy.num_devices)
        self.mine = [s for s in shards if rank in s.devices]
        self.names = {s.name for s in self.mine}
        """Its level-2 and level-3 weights (their leaves' gradients are reduce-scattered per use)."""
        self.freed = {s.name for s in self.mine if s.zero == 3}
        """Its level-3 weights (their leaves' storage is freed between uses)."""
        self.chunks: dict[WeightShard, torch.Tensor] = {}
        """Shard -> this rank's chunk of its flattened region (padded)."""
        for s in self.mine:
            n, numel = len(s.devices), box_numel(s.region)
            flat = state[s.name].detach()[slice_box(s.region)].reshape(-1).to(tensors[s.name].device)
            flat = torch.nn.functional.pad(flat, (0, chunk_numel(numel, n) * n - numel))
            c = chunk_numel(numel, n)
            i = s.devices.index(rank)
            self.chunks[s] = flat[i * c:(i + 1) * c].clone().requires_grad_()
        self.uses: dict[tuple[str, int], list[GatherGroup]] = {}
        """(op, partition) -> the groups of level-2 and level-3 shards it reads on this rank, in
        call order."""
        for u in gather_groups(lowered):
            if rank in u.devices:
                self.uses.setdefault((u.op, u.partitions[u.devices.index(rank)]), []).append(u)
        self.busy: dict[str, int] = {}
        """Weight -> its shards gathered now (its leaf's storage is held while any is)."""
        self.pending: list[tuple[GatherGroup, object, torch.Tensor, torch.Tensor]] = []
        self.inflight: list[list] = []
        """Level-3 all-gather calls started (``start``) whose groups are not all copied out, in
        start order: [its groups, the index of each read not copied yet (a group read twice:
        twice), the work (None once waited), its buffer]."""
        for name in self.freed:
            self._free(name)

    def _free(self, name: str) -> None:
        self.tensors[name].untyped_storage().resize_(0)

    def _view(self, s: WeightShard) -> torch.Tensor:
        """Shard ``s``'s region of its leaf."""
        leaf, index = self.tensors[s.name], self.index(s.name, s.region)
        return leaf.data if index is None else leaf.data[index]

    def start(self, calls: Sequence[Sequence[GatherGroup]]) -> None:
        """Start each call's all-gather (async): one call of the members' chunks of its level-3
        groups concatenated, n rows of Σ c_s over its groups' shards, row i holding member i's
        chunk of each shard in turn (a call of one group: that group's; of a unit's groups:
        ``strategies.prefetch.calls_at``); ``unshard`` waits it. A group the call lists twice (a
        recomputation in its own unit, then the backward: ``strategies.prefetch
        .recomputed_in_unit``) is gathered once and its buffer kept until both copied it out."""
        for reads in calls:
            reads = [u for u in reads if u.zero == 3]
            if not reads:
                continue
            call = list(dict.fromkeys(reads))  # a group read twice (recomputed in its unit): gathered once
            mine = torch.cat([_wire(self.chunks[s].detach(), s) for u in call for s in u.shards])
            pg = self.groups.get(call[0].devices)
            out = mine.new_empty(len(call[0].devices) * mine.numel())
            try:
                work = dist.all_gather_into_tensor(out, mine, group=pg, async_op=True)
            except (RuntimeError, NotImplementedError, ValueError):  # the backend has none: into a list
                out = [torch.empty_like(mine) for _ in call[0].devices]
                work = dist.all_gather(out, mine, group=pg, async_op=True)
            self.inflight.append([call, [call.index(u) for u in reads], work, out])

    def unshard(self, groups: Sequence[GatherGroup]) -> None:
        """Wait the all-gather of each level-3 group (started now where ``start`` did not; a
        call waited once, its buffer freed once every group in it is copied out) and copy
        its columns into its shards' leaves (their storage allocated again where freed)."""
        for u in groups:
            if u.zero != 3:
                continue
            at = next((i for i, f in enumerate(self.inflight) if any(f[0][j] == u for j in f[1])), None)
            if at is None:
                self.start([[u]])
                at = len(self.inflight) - 1
            call, left, work, out = entry = self.inflight[at]
            if work is not None:
                work.wait()
                entry[2] = None
                if isinstance(out, list):  # gathered into a list of rows
                    out = entry[3] = torch.cat(out)
            j = next(j for j in left if call[j] == u)
            left.remove(j)
            if not left:
                self.inflight.pop(at)
            for s in u.shards:
                leaf = self.tensors[s.name]
                if not self.busy.get(s.name):
                    leaf.untyped_storage().resize_(leaf.numel() * leaf.element_size())
                self.busy[s.name] = self.busy.get(s.name, 0) + 1
            start = sum(sum(call[i].chunks) for i in range(j))
            rows = out.view(len(u.devices), -1)[:, start:start + sum(u.chunks)]
            for s, part in zip(u.shards, rows.split(u.chunks, dim=1)):
                view = self._view(s)
                view.copy_(part.reshape(-1)[:view.numel()].view_as(view))

    def reshard(self, groups: Sequence[GatherGroup], backward: bool) -> None:
        """Free the level-3 groups' gathered weights; after a backward first start one
        reduce-scatter of each group's gradients (waited in ``finish``), each shard's padded
        flat gradient cut in n rows and the rows of the shards joined, and free the full
        gradients."""
        if backward:
            for u in groups:
                n, rows = len(u.devices), []
                for s, c in zip(u.shards, u.chunks):
                    leaf, index = self.tensors[s.name], self.index(s.name, s.region)
                    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    g = (grad if index is None else grad[index]).reshape(-1)
                    rows.append(_wire(torch.nn.functional.pad(g, (0, c * n - g.numel())), s, self.strategy).view(n, c))
                x = torch.cat(rows, dim=1).reshape(-1) if len(rows) > 1 else rows[0].reshape(-1)
                out = x.new_empty(sum(u.chunks))
                work = dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=self.groups.get(u.devices),
                                                  async_op=True)
                self.pending.append((u, work, out, x))  # x: kept alive until the work is waited
            for u in groups:
                for s in u.shards:
                    self.tensors[s.name].grad = None
        for u in groups:
            if u.zero != 3:
                continue
            for s in u.shards:
                self.busy[s.name] -= 1
                if not self.busy[s.name]:
                    self._free(s.name)

    @torch.no_grad()
    def gather_chunks(self) -> None:
        """After the update: each level-2 shard's chunks all-gathered into its weight."""
        for s in self.mine:
            if s.zero == 2:
                flat = run_collective("all_gather", _wire(self.chunks[s].detach(), s), self.groups.group(s.devices), 0)
                leaf, index = self.tensors[s.name], self.index(s.name, s.region)
                view = leaf if index is None else leaf[index]
                view.copy_(flat[:view.numel()].view_as(view))

    def finish(self) -> None:
        """Wait for the reduce-scatters started, adding each into its chunk's gradient."""
        for u, work, out, _ in self.pending:
            work.wait()
            for s, part in zip(u.shards, out.split(u.chunks)):
                chunk = self.chunks[s]
                if chunk.grad is None:
                    chunk.grad = part.to(chunk.dtype)
                else:
                    chunk.grad += part
        self.pending = []

    def write(self, name: str, full: torch.Tensor, grads: bool) -> None:
        """Add this rank's chunks of weight ``name`` (or of its summed gradient) into ``full``
        (global coordinates; the members' chunks are disjoint, so a sum over ranks joins them)."""
        for s in self.mine:
            if s.name != name:  # the chunks: the masters (a level-2 leaf may hold the compute-dtype gather)
                continue
            t = self.chunks[s].grad if grads else self.chunks[s].detach()
            if t is None:
                continue
            lo, hi = chunk_span(box_numel(s.region), len(s.devices), s.devices.index(self.rank))
            region = full.new_zeros([h - l for l, h in s.region])
            region.view(-1)[lo:hi] = t[:hi - lo]
            full[slice_box(s.region)] += region

    def holds(self, s: WeightShard) -> bool:
        return s in self.chunks


