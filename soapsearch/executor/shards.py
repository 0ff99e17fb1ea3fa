"""The weights one rank holds: for each weight it reads, one tensor over the bounding box of
the shard regions the lowering gives this device (``Lowered.weight_shards``), a leaf with
``requires_grad`` when trainable. Partitions read views of it, so autograd accumulates every
partition's weight gradient into the one leaf; each replicated shard's gradient is then summed
over exactly its devices (data-parallel gradient sync, restricted to the shard's replicas).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import ProcessGroups
from strategies.lowering import BucketKey, Lowered, bucket_key
from strategies.region import Box, index_in, shift_box, slice_box

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
        self.params = [t for _, t in sorted(self.tensors.items()) if t.requires_grad]
        self.buckets = self._buckets()

    def index(self, name: str, region: Box) -> tuple[slice, ...] | None:
        """The view of weight ``name``'s local leaf that ``region`` (global coordinates) is; None
        when it is the whole leaf."""
        return index_in(region, self.origin[name])

    def view(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """The view ``index`` (from ``index``) of weight ``name``'s local leaf."""
        t = self.tensors[name]
        return t if index is None else t[index]

    def parameters(self) -> list[torch.Tensor]:
        """The trainable leaves, in a fixed order (for the optimizer), listed once."""
        return self.params

    def _buckets(self) -> dict[BucketKey, list[tuple[str, tuple[slice, ...] | None]]]:
        """The shards this rank holds in each gradient bucket (``strategies.lowering.bucket_key``,
        the buckets the simulator times): key -> [(weight name, its view ``index``)]."""
        buckets: dict[BucketKey, list] = {}
        for s in self.mine:
            key = bucket_key(s)
            if key is not None:
                buckets.setdefault(key, []).append((s.name, self.index(s.name, s.region)))
        return buckets

    def sync_grads(self, groups: ProcessGroups,
                   riders: Mapping[BucketKey, Sequence[torch.Tensor]] | None = None,
                   ) -> dict[BucketKey, list[torch.Tensor]]:
        """Sum each replicated trainable shard's gradient over its devices: one flat tensor
        per gradient bucket (device set, dtype), as DDP buckets its gradients, reduced in sorted
        order of the keys on every rank (one global order of collectives: no cycle can wait). ``riders``
        (bucket key -> small tensors, in one order on every member: the STEP sums of
        ``strategies.lowering.bucket_sums``) are appended to their bucket's flat tensor, so one
        all-reduce sums both; returns their sums, key -> tensors in the order given."""
        riders = riders or {}
        for t in self.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        pending = []
        for key in sorted(set(self.buckets) | set(riders)):
            grads = [self.tensors[name].grad if index is None else self.tensors[name].grad[index]
                     for name, index in self.buckets.get(key, ())]
            extra = list(riders.get(key, ()))
            flat = torch.cat([g.reshape(-1) for g in grads] + [t.reshape(-1) for t in extra])
            # mixed precision: reduced in the bucket's (compute) dtype, FSDP2's reduce_dtype
            flat = flat.to(getattr(torch, key.dtype))
            work = dist.all_reduce(flat, group=groups.get(key.devices), async_op=True)
            pending.append((key, work, flat, grads, extra))
        sums = {}
        for key, work, flat, grads, extra in pending:
            work.wait()
            parts = flat.split([g.numel() for g in grads] + [t.numel() for t in extra])
            for g, summed in zip(grads, parts):
                g.copy_(summed.view_as(g))
            sums[key] = [summed.view_as(t) for t, summed in zip(extra, parts[len(grads):])]
        return sums

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
            for s in owned[name]:
                if s.devices[0] == self.rank:
                    src = self.tensors[name].grad if grads else self.tensors[name]
                    if src is not None:
                        full[slice_box(s.region)] = src.detach()[slice_box(shift_box(s.region, self.origin[name]))]
            dist.reduce(full, dst=0)
            out[name] = full
        return out if self.rank == 0 else None
