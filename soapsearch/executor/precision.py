"""Mixed precision in the executor (docs/design.md, "Mixed precision"): each partition's forward
under ``torch.autocast(compute dtype)`` over float32 master leaves, what moves between ranks
cast to the dtype the lowering gives it (the compute graph's, ``strategies.precision``: what the
simulator charges), a loss computed in float32, and, for fp16, a dynamic loss scaler with
``torch.amp.GradScaler``'s semantics shared by every rank.

In "model" precision every helper here is the identity: the lowering's dtypes are the model's."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.config import TrainConfig
from strategies.strategy import Strategy

__all__ = ["Autocast", "LossScaler", "to_wire"]


def to_wire(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` in ``dtype`` (the lowering's dtype of what it is a piece of) when both are floating
    and differ; ``t`` itself otherwise (integer tensors move as they are)."""
    if dtype is None or t.dtype == dtype or not t.is_floating_point() or not dtype.is_floating_point:
        return t
    return t.to(dtype)


class Autocast:
    """How a partition's forward runs under ``strategy``'s precision: the op's rule under
    ``torch.autocast(device, compute dtype)`` (its op lists decide what runs in float32), a
    loss op outside it with its floating inputs in float32 (autocast runs losses in float32:
    ``cross_entropy``, ``mse_loss`` are on its float32 lists), so the loss's value and its
    sums stay float32 as the lowering says."""

    def __init__(self, strategy: Strategy, device: torch.device):
        name = strategy.compute_dtype
        self.dtype: torch.dtype | None = getattr(torch, name) if name is not None else None
        self.device_type = device.type

    def run(self, kind: str, fn: Callable, inputs: Sequence[torch.Tensor | None], weights: dict) -> torch.Tensor:
        if self.dtype is None:
            return fn(inputs, weights)
        if kind == "loss":
            with torch.autocast(self.device_type, enabled=False):
                return fn([x.float() if x is not None and x.is_floating_point() else x for x in inputs], weights)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return fn(inputs, weights)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, section 3.2), with
    ``torch.amp.GradScaler``'s semantics and defaults: the output gradients' seed is multiplied
    by ``scale``; after the gradient sync every local gradient is multiplied by the float32
    reciprocal of ``scale`` (``torch._amp_foreach_non_finite_check_and_unscale_``, as
    ``GradScaler.unscale_``), and an inf or nan found on any rank (one all-reduce of the flags
    over the world, MAX) skips the optimizer step on every rank and multiplies ``scale`` by
    ``backoff_factor``; ``growth_interval`` steps in a row without one multiply it by
    ``growth_factor``. The scale is a power of two, so scaling the seed is exact."""

    def __init__(self, config: TrainConfig, device: torch.device):
        self.scale = float(config.loss_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = 2.0, 0.5, 2000
        self.growth_tracker = 0
        self.device = device

    def unscale(self, params: Sequence[torch.Tensor]) -> bool:
        """Unscale the gradients of ``params`` in place; True when every rank found them finite
        (then ``update`` may step). Called by every rank (one all-reduce)."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = torch.full((1,), self.scale, dtype=torch.float64, device=self.device).reciprocal().float()
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return not found.item()

    def update(self, finite: bool) -> None:
        """``GradScaler.update``: back off on a skipped step, grow after ``growth_interval``
        finite ones."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
