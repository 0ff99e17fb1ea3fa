"""One partition's forward and backward step on this rank: its compute (the op rule's forward,
a training batchnorm, under the plan's autocast), its sends, its autograd call."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from soapsearch.executor.comm import Group, all_reduce_sum
from soapsearch.executor.norm import batch_norm
from soapsearch.executor.precision import to_wire
from soapsearch.executor.recipe import ROOT, SKIP, Recipe
from soapsearch.executor.release import Released, SavedStorages, regathered
from strategies.lowering import WEIGHT_KINDS
from strategies.rules import get_rule
from strategies.rules.base import no_reduce
from strategies.rules.cross_entropy import ClassShards
from strategies.rules.norm import uses_batch_stats

__all__ = ["PartitionSteps"]


class PartitionSteps:
    """Mixed into ``runtime.Executor``."""

    def _forward(self, r: Recipe) -> None:
        kind = r.node.kind
        if kind in WEIGHT_KINDS:
            return  # consumers read their own replica of it
        if kind == "input":
            out = self.batch[r.node.attrs["index"]][r.box]
        elif r.recompute:  # no autograd graph: nothing saved for backward (torch.utils.checkpoint)
            with torch.no_grad():
                inputs, _ = self._inputs(r, leaves=False)
                out = self._run(r, inputs)
            self.saved[r.id] = tuple(x if keep else None for x, keep in zip(inputs, r.keeps))
        elif r.id in self.guarded:
            self.saved_storages[r.id] = seen = SavedStorages(regathered(r.slots, self.lives, self.shared), self.shared)
            with seen.hooks():
                inputs, self.leaves[r.id] = self._inputs(r)
                out = self._run(r, inputs)
        else:
            inputs, self.leaves[r.id] = self._inputs(r)
            out = self._run(r, inputs)
        self.outs[r.id] = out
        if r.loss and r.loss_sum is None:
            self.losses.append(out.detach())
        if r.sends:  # in the lowering's dtype (mixed precision: the compute dtype)
            data = to_wire(out.detach(), getattr(torch, r.node.output.dtype))
            for s in r.sends:
                self.p2p.send(data if s.src is None else data[s.src], s.peer, s.transfer, backward=False)
        for i in r.frees:  # dropped or transient outputs whose last reader here has run
            if self.recipes[i].recompute:
                self.outs[i] = None
            else:
                self._release(i)

    def _run(self, r: Recipe, inputs: list[torch.Tensor | None]) -> torch.Tensor:
        """``r``'s partition computed from ``inputs`` and its weight views, under the plan's
        autocast (mixed precision; a plain call otherwise): the forward and a recomputation alike."""
        return self.autocast.run(r.node.kind, self.compute[r.id], inputs,
                                 {role: self.weights.view(name, index) for role, name, index in r.weights})

    def _compute(self, r: Recipe, group: Group | None, shards: ClassShards) -> Callable | None:
        """``(inputs, weights) -> output`` of ``r``'s partition: its op rule's forward with the
        reduce of its group (a loss's: and its class shards' collectives), or norm.batch_norm
        for a training batchnorm; None for a weight or an input."""
        node = r.node
        if node.kind in (*WEIGHT_KINDS, "input"):
            return None
        if node.kind == "batchnorm2d" and uses_batch_stats(node):
            return partial(self._batch_norm, r, group)
        if r.loss_sum is not None:
            return partial(self._loss, r, group, shards)
        reduce = no_reduce if group is None else partial(all_reduce_sum, group=group)
        extra = {"shards": shards} if node.kind == "loss" else {}
        return partial(get_rule(node.kind).forward, node, r.part.box, reduce=reduce, **extra)

    def _batch_norm(self, r: Recipe, group: Group | None, inputs: list[torch.Tensor],
                    weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """norm.batch_norm, counting the op's batches as torch's num_batches_tracked does."""
        if r.node.attrs["training"] and "running_mean" in weights:
            self.bn_steps[r.part.op] = self.bn_steps.get(r.part.op, 0) + 1
        return batch_norm(r.node, inputs[0], weights, group,
                          self.bn_base.get(r.part.op, 0) + self.bn_steps.get(r.part.op, 0))

    def _backward(self, r: Recipe) -> None:
        if r.backward == SKIP:
            return
        out, self.outs[r.id] = self.outs[r.id], None
        self.saved_storages.pop(r.id, None)
        if r.backward == ROOT:
            grad = self._output_grad(r, out)
            if out.requires_grad:
                torch.autograd.backward(out.edge if isinstance(out, Released) else out, grad)
        leaves = self.leaves[r.id]
        for s in r.grad_sends:
            leaf = leaves[s.slot] if leaves is not None else None
            g = leaf.grad if leaf is not None else None
            if g is None:
                g = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            self.p2p.send(to_wire(g if s.src is None else g[s.src], s.dtype), s.peer, s.transfer, backward=True)
