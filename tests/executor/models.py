"""Small models whose losses the zoo lacks, for the parity tests: a mean MSE and a summed
cross-entropy (static divisors: ``Loss.static_count``), a mean cross-entropy with class
weights, ignored targets and label smoothing (a divisor Σ w_i known only from the data), and a
loss that is not the model's output (its sum gates the forward: the generic reduce path).
Factories for ``build_model("tests.executor.models:<name>")``: (model, example inputs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SPEC = f"{__name__}:"
"""The prefix of this file's model specs (``SPEC + "weighted"``)."""
CLASSES = 6
IGNORE = 2


class _Body(nn.Module):
    def __init__(self, out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, out)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Regression(_Body):
    """Mean squared error over a [batch, 3, 4] prediction: C = batch·12."""

    def __init__(self):
        super().__init__(4)

    def forward(self, x, y):
        return F.mse_loss(super().forward(x), y)


class Weighted(_Body):
    """Mean cross-entropy, class weights, targets equal to IGNORE skipped, label smoothing."""

    def __init__(self):
        super().__init__(CLASSES)
        self.loss = nn.CrossEntropyLoss(weight=torch.rand(CLASSES) + 0.5, ignore_index=IGNORE,
                                        label_smoothing=0.1)

    def forward(self, x, t):
        return self.loss(super().forward(x), t)


class Summed(_Body):
    """Summed cross-entropy with class weights: C = 1."""

    def __init__(self):
        super().__init__(CLASSES)
        self.register_buffer("cw", torch.rand(CLASSES) + 0.5)

    def forward(self, x, t):
        return F.cross_entropy(super().forward(x), t, weight=self.cw, ignore_index=IGNORE, reduction="sum")


class Scaled(_Body):
    """Half the mean cross-entropy: the loss op feeds an elementwise op, the graph's output."""

    def __init__(self):
        super().__init__(CLASSES)

    def forward(self, x, t):
        return F.cross_entropy(super().forward(x), t) * 0.5


class Opaque(nn.Module):
    """Ops no rule covers (an nn.Bilinear module with weights, a flip function, an in-place
    method) between two linears: each runs whole on one device (``strategies.rules.opaque``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bilinear = nn.Bilinear(6, 6, 6)
        self.out = nn.Linear(6, CLASSES)

    def forward(self, x, t):
        h = self.bilinear(self.fc(x), x.tanh().repeat(1, 2)[:, :6])
        h = torch.flip(h, [1]).relu_()
        return F.cross_entropy(self.out(h), t)


class Bottleneck(nn.Module):
    """A linear reading a linear (a low-rank factorised layer): cut row-parallel then
    column-parallel, the second reads the first's Partial sums whole on every device (an
    all-reduce, ``strategies.collectives``)."""

    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Linear(8, 4), nn.Linear(4, 8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x, t):
        return F.cross_entropy(self.out(torch.tanh(self.up(self.down(x)))), t)


def _targets(batch_size: int) -> torch.Tensor:
    t = torch.randint(0, CLASSES, (batch_size,))
    t[: batch_size // 4] = IGNORE  # the first quarter ignored: a whole partition may count 0
    return t


def regression(batch_size: int = 8):
    return Regression(), (torch.randn(batch_size, 3, 5), torch.randn(batch_size, 3, 4))


def weighted(batch_size: int = 8):
    return Weighted(), (torch.randn(batch_size, 5), _targets(batch_size))


def summed(batch_size: int = 8):
    return Summed(), (torch.randn(batch_size, 5), _targets(batch_size))


def scaled(batch_size: int = 8):
    return Scaled(), (torch.randn(batch_size, 5), _targets(batch_size))


def opaque(batch_size: int = 8):
    return Opaque(), (torch.randn(batch_size, 5), _targets(batch_size))


def bottleneck(batch_size: int = 8):
    return Bottleneck(), (torch.randn(batch_size, 8), _targets(batch_size))
