"""What a training run needs besides the plan: the optimizer and its settings, the timeout.
One source of defaults; ``soapsearch.run`` maps its flags onto it (STYLE.md 6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["TrainConfig", "OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "sgd"
    """``sgd`` (torch.optim.SGD with ``momentum``) or ``adam`` (torch.optim.Adam)."""
    lr: float = 0.01
    """Learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's betas."""
    weight_decay: float = 0.0
    """L2 penalty of either optimizer (elementwise, so a shard's update is the full update's slice)."""
    timeout_s: float = 300.0
    """Longest wait for any receive or collective before the run fails naming the peer."""
    loss_scale: float = 2.0**16
    """fp16 plans: the dynamic loss scaler's initial scale (``torch.amp.GradScaler``'s
    ``init_scale``; a power of two, so scaling is exact); other precisions ignore it."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"lr = {self.lr}: the learning rate must be > 0")
        if not 0 < self.timeout_s <= 1e9:  # false for nan too; inf would overflow the c10d timedelta
            raise ValueError(f"timeout = {self.timeout_s}: must be a number of seconds > 0 (and <= 1e9)")
        if not (self.loss_scale > 0 and math.log2(self.loss_scale).is_integer()):
            raise ValueError(f"loss_scale = {self.loss_scale}: must be a power of two > 0 (scaling the "
                             "loss's gradient by it is then exact)")


def make_optimizer(params: Iterable[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    """torch.optim on ``params``: SGD and Adam update each element from its own gradient and
    state only, so the update of a shard equals that slice of the full model's update."""
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
