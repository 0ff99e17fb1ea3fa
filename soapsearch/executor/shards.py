"""The weights one rank holds: for each weight it reads, one tensor over the bounding box of
the shard regions the lowering gives this device (``Lowered.weight_shards``), a leaf with
``requires_grad`` when trainable. Partitions read views of it, so autograd accumulates every
partition's weight gradient into the one leaf; each replicated shard's gradient is then summed
over exactly its devices (data-parallel gradient sync, restricted to the shard's replicas), one flat tensor per gradient bucket, started as soon as the bucket's gradients are
final (``strategies.overlap``) and waited at the step end.

Level-1 buckets (``BucketKey.zero`` 1, ``strategies.zero``): the bucket's gradients are
packed into one flat tensor and reduce-scattered; this rank keeps its chunk of the sum as the
gradient of a flat chunk tensor (``chunks``) that the optimizer updates in place of the
bucket's weights (so it holds their optimizer state for the chunk only), frees the weights'
full gradients, and after the update all-gathers the chunks into the weights (``gather_chunks``).
Level-2 and level-3 shards are reduce-scattered per use, level 3's weights kept as chunks and
gathered per use (``gathered.GatheredWeights``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import ProcessGroups, run_collective
from soapsearch.executor.gathered import GatheredWeights
from strategies.lowering import BucketKey, Lowered
from strategies.overlap import bucket_order
from strategies.precision import reduce_dtype
from strategies.region import Box, box_numel, index_in, shift_box, slice_box
from strategies.zero import ZeroBucket, chunk_span, zero_buckets

__all__ = ["LocalWeights"]


def _bounding(boxes: list[Box]) -> Box:
    return tuple((min(b[i][0] for b in boxes), max(b[i][1] for b in boxes)) for i in range(len(boxes[0])))


class LocalWeights:
    """This rank's shards, cut from ``state`` (the full model's state_dict, the same on every
    rank: same seed)."""

    def __init__(self, lowered: Lowered, state: Mapping[str, torch.Tensor], rank: int, device: torch.device):
        self.lowered, self.rank, self.device = lowered, rank, device
        self.mine = [s for s in lowered.weight_shards if rank in s.devices]
        regions: dict[str, list[Box]] = {}
        trainable: dict[str, bool] = {}
        for s in self.mine:
            regions.setdefault(s.name, []).append(s.region)
            trainable[s.name] = s.trainable
        self.origin: dict[str, Box] = {n: _bounding(bs) for n, bs in regions.items()}
        self.dtypes = {name: t.dtype for name, t in state.items()}
        """Weight name -> its dtype in the model (a mixed precision plan's master dtype, float32)."""
        self.tensors: dict[str, torch.Tensor] = {}
        for name, box in self.origin.items():
            if name not in state:
                raise KeyError(f"weight {name!r} is not in the model's state_dict")
            full = state[name]
            t = full.detach()[slice_box(box)].to(device=device).clone()
            self.tensors[name] = t.requires_grad_(trainable[name] and t.is_floating_point())
        self.buckets = self._buckets()
        self.order = [k for k in bucket_order(lowered) if rank in k.devices]
        """The level-0 and level-1 buckets this rank is a member of, in the one order every
        member starts them (``strategies.overlap.bucket_order``)."""
        self.started: dict[BucketKey, tuple] = {}
        """Bucket -> its collective in flight this step (``start_bucket``), until waited."""
        self.zero: dict[BucketKey, ZeroBucket] = {k: b for k, b in zero_buckets(lowered).items()
                                                   if rank in k.devices}
        """The sharded buckets this rank is a member of, in sorted key order."""
        self.fsdp = GatheredWeights(lowered, rank, self.tensors, self.index, state)
        """Its level-3 shards (FSDP): chunks kept, gathered per use."""
        sharded = {s.name for b in self.zero.values() for s in b.shards} | self.fsdp.names
        self.chunks: dict[BucketKey, torch.Tensor] = {k: self._flat(k, grads=False)[self._chunk(b)].clone()
                                                      .requires_grad_() for k, b in self.zero.items()}
        """Sharded bucket -> this rank's chunk of its flat weights (padded), the tensor the
        optimizer updates (``strategies.zero``: member i owns chunk i)."""
        self.params = [t for n, t in sorted(self.tensors.items()) if t.requires_grad and n not in sharded]
        self.params += list(self.chunks.values()) + list(self.fsdp.chunks.values())

    def index(self, name: str, region: Box) -> tuple[slice, ...] | None:
        """The view of weight ``name``'s local leaf that ``region`` (global coordinates) is; None
        when it is the whole leaf."""
        return index_in(region, self.origin[name])

    def view(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The view ``index`` (from ``index``) of weight ``name``'s local leaf."""
        t = self.tensors[name]
        return t if index is None else t[index]

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer updates, in a fixed order, listed once: the trainable leaves in no
        sharded bucket, then this rank's chunk of each sharded bucket."""
        return self.params

    def grad_holders(self) -> list[torch.Tensor]:
        """Every tensor whose ``.grad`` holds part of this rank's gradient now: the trainable
        leaves (before the sync) and the chunks (after it; level 3's once their reduce-scatters
        are waited, here)."""
        self.fsdp.finish()
        return ([t for t in self.tensors.values() if t.requires_grad] + list(self.chunks.values())
                + list(self.fsdp.chunks.values()))

    def _chunk(self, b: ZeroBucket) -> slice:
        i = b.key.devices.index(self.rank)
        return slice(i * b.chunk, (i + 1) * b.chunk)

    def _flat(self, key: BucketKey, grads: bool) -> torch.Tensor:
        """Bucket ``key``'s weights (or their gradients), flattened in its order and padded to
        n chunks (``strategies.zero``)."""
        b = self.zero[key]
        parts = [(self.tensors[name].grad if grads else self.tensors[name].detach()) for name, _ in self.buckets[key]]
        parts = [t if index is None else t[index] for t, (_, index) in zip(parts, self.buckets[key])]
        flat = torch.cat([t.reshape(-1) for t in parts])
        return torch.nn.functional.pad(flat, (0, b.chunk * len(key.devices) - b.numel))

    def _buckets(self) -> dict[BucketKey, list[tuple[str, tuple[slice, ...] | None]]]:
        """The shards this rank holds in each gradient bucket (``GradientSync.shard_buckets``: cut
        at the plan's cap, ``strategies.lowered.split_buckets``; the buckets the simulator
        times): key -> [(weight name, its view ``index``)]."""
        buckets: dict[BucketKey, list] = {}
        for s, key in zip(self.lowered.weight_shards, self.lowered.gradient_sync.shard_buckets):
            if key is not None and self.rank in s.devices:
                buckets.setdefault(key, []).append((s.name, self.index(s.name, s.region)))
        return buckets

    def start_bucket(self, key: BucketKey, groups: ProcessGroups, riders: Sequence[torch.Tensor] = ()) -> None:
        """Start gradient bucket ``key``'s collective without waiting (``async_op``, as DDP's
        buckets): its gradients packed into one flat tensor in the dtype the plan reduces them
        in (``strategies.precision.reduce_dtype``, FSDP2's reduce_dtype), all-reduced, or at level 1 reduce-scattered (this rank's chunk of
        the sum is its chunk's gradient). Called once the bucket's gradients are final here
        (``strategies.overlap.bucket_issues``), in ``bucket_order`` on every member. ``riders``
        (small tensors in one order on every member: the STEP sums of
        ``strategies.lowering.bucket_sums``) are appended to a level-0 bucket's flat tensor, so
        one all-reduce sums both."""
        for name, _ in self.buckets.get(key, ()):  # a leaf no partition here sent a gradient into
            t = self.tensors[name]
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        dtype = getattr(torch, reduce_dtype(self.lowered.strategy, key.dtype))
        if key in self.zero:
            x = self._flat(key, grads=True).to(dtype)
            out = x.new_empty(self.zero[key].chunk)
            work = dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=groups.get(key.devices),
                                              async_op=True)
            self.started[key] = (work, out, x, [])  # x: kept alive until the work is waited
            return
        grads = [self.tensors[name].grad if index is None else self.tensors[name].grad[index]
                 for name, index in self.buckets.get(key, ())]
        flat = torch.cat([g.reshape(-1) for g in grads] + [t.reshape(-1) for t in riders]).to(dtype)
        work = dist.all_reduce(flat, group=groups.get(key.devices), async_op=True)
        self.started[key] = (work, flat, grads, list(riders))

    def sync_grads(self, groups: ProcessGroups,
                   riders: Mapping[BucketKey, Sequence[torch.Tensor]] | None = None,
                   ) -> dict[BucketKey, list[torch.Tensor]]:
        """Sum each replicated trainable shard's gradient over its devices: start every bucket
        of this rank not started yet (``start_bucket``, in ``bucket_order``; ``riders``: key ->
        its riding sums' terms) and wait for each, copying the sums back into the gradients
        (level 1: keeping this rank's chunk as its chunk's gradient). Returns the riding sums,
        key -> tensors in the order given."""
        riders = riders or {}
        self.fsdp.finish()
        for key in self.order:
            if key not in self.started:
                self.start_bucket(key, groups, riders.get(key, ()))
        sums = {}
        for key in self.order:
            work, flat, grads, extra = self.started.pop(key)
            work.wait()
            if key in self.zero:
                chunk = self.chunks[key]
                chunk.grad = flat.to(chunk.dtype)
                continue
            parts = flat.split([g.numel() for g in grads] + [t.numel() for t in extra])
            for g, summed in zip(grads, parts):
                g.copy_(summed.view_as(g))
            sums[key] = [summed.view_as(t) for t, summed in zip(extra, parts[len(grads):])]
        for name, t in self.tensors.items():  # shards in no bucket (held here only)
            if t.requires_grad and t.grad is None and name not in self.fsdp.names:
                t.grad = torch.zeros_like(t)
        for b in self.zero.values():  # their full gradients are not read again this step
            for s in b.shards:
                self.tensors[s.name].grad = None
        return sums

    @torch.no_grad()
    def gather_chunks(self, groups: ProcessGroups) -> None:
        """After the update: each level-1 bucket's chunks all-gathered (sorted key order) and
        copied into the weights, then each level-2 shard's (``GatheredWeights.gather_chunks``)."""
        for key, b in self.zero.items():
            flat = run_collective("all_gather", self.chunks[key].detach().to(getattr(torch, key.dtype)),
                                  groups.group(key.devices), 0)
            parts = flat[:b.numel].split([box_numel(s.region) for s in b.shards])
            for (name, index), part in zip(self.buckets[key], parts):
                view = self.tensors[name] if index is None else self.tensors[name][index]
                view.copy_(part.view_as(view))
        self.fsdp.gather_chunks()

    def _chunk_write(self, name: str, full: torch.Tensor, grads: bool) -> None:
        """Write this rank's chunks of weight ``name`` (the master values the optimizer updates:
        in mixed precision the leaves hold what the compute-dtype all-gather gave) or of its
        summed gradient into ``full``."""
        for key, b in self.zero.items():
            lo, hi = chunk_span(b.numel, len(key.devices), key.devices.index(self.rank))
            chunk = self.chunks[key]
            grad, at, start = chunk.grad if grads else chunk.detach(), 0, self._chunk(b).start
            for s in b.shards:
                k = box_numel(s.region)
                a, z = max(lo, at), min(hi, at + k)
                if s.name == name and a < z and grad is not None:
                    region = full.new_zeros([h - l for l, h in s.region])
                    region.view(-1)[a - at:z - at] = grad[a - start:z - start]
                    full[slice_box(s.region)] += region
                at += k

    def gather(self, grads: bool = False) -> dict[str, torch.Tensor] | None:
        """Every weight as a full tensor on rank 0 (None elsewhere): each shard is written by
        the first device holding it, then one sum-reduce per weight to rank 0."""
        specs = {w.name: w.spec for n in self.lowered.graph for w in n.weights}
        owned: dict[str, list] = {}
        for s in self.lowered.weight_shards:
            if grads and not s.trainable:
                continue
            owned.setdefault(s.name, []).append(s)
        out = {}
        for name in sorted(owned):
            like = self.tensors.get(name)
            dtype = like.dtype if like is not None else self.dtypes[name]  # the model's (master) dtype
            full = torch.zeros(specs[name].shape, dtype=dtype, device=self.device)
            self._chunk_write(name, full, grads)
            self.fsdp.write(name, full, grads)
            for s in owned[name]:
                if s.devices[0] == self.rank and not s.zero:  # else its chunks (the masters)
                    src = self.tensors[name].grad if grads else self.tensors[name]
                    if src is not None:
                        full[slice_box(s.region)] = src.detach()[slice_box(shift_box(s.region, self.origin[name]))]
            dist.reduce(full, dst=0)
            out[name] = full
        return out if self.rank == 0 else None
