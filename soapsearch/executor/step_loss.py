"""The step's loss on this rank: the loss partitions' sums (their own collective or riding a
gradient bucket), the division by a dynamic count, and the value reported on every rank."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from soapsearch.executor.comm import BucketSum, Group, PendingSum
from soapsearch.executor.recipe import Recipe
from strategies.lowering import BucketKey, Gate
from strategies.rules import get_rule
from strategies.rules.cross_entropy import ClassShards

__all__ = ["StepLoss"]


class StepLoss:
    """Mixed into ``runtime.Executor``.

    The step's loss is L = (1/m)·Σ_j S_j / C_j over the m micro-batches, S_j = Σ_p s_p
    and C_j = Σ_p c_p (or the static count C, ``Loss.static_count``) over the loss op's partitions
    p, each computing s_p = Σ_{i∈p} w_i·ℓ_i and c_p = Σ_{i∈p} w_i (``Loss.partial``). A partition
    outputs s_p / C when C is static, else s_p; right after its forward it starts the sum of
    [s_p, c_p] (s_p alone for a static C) over its reduction group (``Group.sum_async``) and goes
    on — unless that sum rides a gradient bucket (``strategies.lowering.bucket_sums``: a STEP sum
    whose devices and dtype are a bucket's): then its terms are appended to that bucket's flat
    all-reduce in the gradient sync (``LocalWeights.sync_grads``; on every member in (op,
    micro-batch) order), one collective for both, as DDP's one per step. dL/ds_p = 1/(m·C_j), so
    what waits for that sum is what its reduction's gates say (``strategies.lowering.gates``):

    - ``Gate.STEP``, static C: the seed is 1/m; nothing waits but the reported loss.
    - ``Gate.STEP``, dynamic C (m = 1, a loss partition on every rank): the seed is 1/m, and every local
      gradient is divided by C (every gradient is linear in the seeds, and every seed was C times
      too large): after the gradient sync (1/C·Σ_r g_r = Σ_r g_r/C: the buckets start before C
      is known), shards in no bucket included.
    - ``Gate.BACKWARD``: the partition's backward step of micro-batch j waits for the sum; seed 1/(m·C_j).
    - a partition alone (no group) knows C_j itself; seed 1/(m·C_j).

    The loss's backward has no collective. The reported loss is (1/m)·Σ_j S_j / C_j from the sums;
    when some rank holds no loss partition, partition 0's rank counts it and an all-reduce started
    after the gradient sync, and waited after the optimizer update it overlaps, tells the others."""

    def _divide_grads(self) -> None:
        """STEP with a dynamic C (m = 1, every rank a loss partition): wait for the loss's sum
        and divide every local gradient by C = Σ c_p (the seed was 1/m, not 1/(m·C)), after the
        gradient sync (1/C·Σ_r g_r = Σ_r g_r/C: the buckets start before C is known)."""
        for r, pending in self.sums.values():
            ls = r.loss_sum
            if ls.count is None and ls.gates is Gate.STEP:
                count = pending.wait()[1]
                for t in self.weights.grad_holders():
                    if t.grad is not None:
                        t.grad.div_(count)

    def _riders(self) -> dict[BucketKey, list[BucketSum]]:
        """The loss sums that ride a bucket, in (op, micro-batch) order (every member of a
        bucket holds one partition of each such sum: its devices are the bucket's); all known
        once this rank's forwards have run, before its last backward pass."""
        riding = sorted((r.part.op, r.part.microbatch, r.id) for r, p in self.sums.values()
                        if isinstance(p, BucketSum))
        riders: dict[BucketKey, list[BucketSum]] = {}
        for _, _, i in riding:
            r, pending = self.sums[i]
            riders.setdefault(r.loss_sum.bucket, []).append(pending)
        return riders

    def _sync_grads(self) -> None:
        """The gradient sync (``LocalWeights.sync_grads``): the buckets not started yet
        started with their riding loss sums, every bucket waited, then the division by a
        dynamic C."""
        riders = self._riders()
        sums = self.weights.sync_grads(self.bucket_groups, {k: [p.terms for p in ps] for k, ps in riders.items()})
        for key, pendings in riders.items():
            for pending, total in zip(pendings, sums[key]):
                pending.value = total
        self._divide_grads()

    def _step_loss(self) -> Callable[[], float]:
        """Σ_j S_j / C_j of the micro-batches this rank counts (float64: each term is exactly a
        double), summed over the world when some rank holds no loss partition: that all-reduce
        is started here and waited by the returned call, which ``step`` makes after the
        optimizer update (nothing in it reads the value), so the two overlap. Every sum this
        rank started is waited here, counted or not (its buffers live until it is done)."""
        loss = sum(v.item() for v in self.losses)
        for r, pending in self.sums.values():
            total = pending.wait()
            if r.loss:
                loss += (total[0] / (r.loss_sum.count if r.loss_sum.count is not None else total[1])).item()
        if self.loss_everywhere:
            return lambda: loss
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(total, async_op=True)

        def value() -> float:
            work.wait()
            return total.item()
        return value

    def _loss(self, r: Recipe, group: Group | None, shards: ClassShards, inputs: list[torch.Tensor],
              weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """A loss partition (class docstring): s_p / C (static C) or s_p, its group's sum of
        [s_p, c_p] (of s_p alone for a static C) started, not waited, or left to ride its
        gradient bucket; a class cut's max and sum over its class shards first (``Loss.partial``)."""
        s, c = get_rule("loss").partial(r.node, r.part.box, inputs, weights, shards)
        terms = torch.stack([s.detach(), c]) if r.loss_sum.count is None else s.detach().reshape(1)
        if r.loss_sum.bucket is not None:
            self.sums[r.id] = (r, BucketSum(terms))
        else:
            self.sums[r.id] = (r, group.sum_async(terms) if group is not None else PendingSum(None, [terms]))
        return s / r.loss_sum.count if r.loss_sum.count is not None else s
