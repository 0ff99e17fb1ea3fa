"""Small graphs whose every plan is enumerated (issue 23's proof that the search reaches the
optimum): 2-8 ops each — chains, branches, a residual, a loss — on 2-4 devices of topologies
with fast (NVLink, NVSwitch) and slow (PCIe, InfiniBand between nodes, shared memory) links.
``tests/search/test_optimum.py`` and ``benchmarks/search_optimum.py`` share them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch import trace
from strategies.graph import OpGraph

__all__ = ["CASES", "Case"]


class Linear(nn.Module):  # a chain: input, linear, loss
    def __init__(self, d=64, c=32):
        super().__init__()
        self.fc = nn.Linear(d, c)

    def forward(self, x, t):
        return F.cross_entropy(self.fc(x), t)


class Chain2(nn.Module):  # linear, relu, linear, loss
    def __init__(self, d=64, h=128, c=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x, t):
        return F.cross_entropy(self.b(torch.relu(self.a(x))), t)


class Branch(nn.Module):  # two linears of one input, added
    def __init__(self, d=64, c=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, c), nn.Linear(d, c)

    def forward(self, x, t):
        return F.cross_entropy(self.a(x) + self.b(x), t)


class Residual(nn.Module):  # x + linear(x), then a head
    def __init__(self, d=64, c=16):
        super().__init__()
        self.a, self.head = nn.Linear(d, d), nn.Linear(d, c)

    def forward(self, x, t):
        return F.cross_entropy(self.head(x + self.a(x)), t)


class Wide(nn.Module):  # a wide weight on a small batch: tensor parallelism pays
    def __init__(self, d=1024, c=4096):
        super().__init__()
        self.fc = nn.Linear(d, c)

    def forward(self, x, t):
        return F.cross_entropy(self.fc(x), t)


class Mse(nn.Module):  # linear, tanh, mse loss
    def __init__(self, d=256, h=256):
        super().__init__()
        self.fc = nn.Linear(d, h)

    def forward(self, x, y):
        return F.mse_loss(torch.tanh(self.fc(x)), y)


def _graph(module: Callable[[], nn.Module], batch: int, d: int, target: str, c: int = 0) -> Callable[[], OpGraph]:
    def build() -> OpGraph:
        with torch.device("meta"):
            model = module()
        x = torch.empty(batch, d, device="meta")
        t = (torch.empty(batch, dtype=torch.long, device="meta") if target == "class"
             else torch.empty(batch, c, device="meta"))
        return trace(model, (x, t), name=module.__name__.lower())
    return build


@dataclass(frozen=True)
class Case:
    name: str
    graph: Callable[[], OpGraph]
    topology: str
    num_devices: int


CASES = (
    Case("linear/p100-1x2", _graph(Linear, 64, 64, "class"), "p100-1x2", 2),
    Case("chain2/k80-1x2", _graph(Chain2, 64, 64, "class"), "k80-1x2", 2),
    Case("branch/p100-2x1", _graph(Branch, 64, 64, "class"), "p100-2x1", 2),
    Case("residual/local-cpu-2", _graph(Residual, 32, 64, "class"), "local-cpu-2", 2),
    Case("wide/a100-1x4", _graph(Wide, 8, 1024, "class"), "a100-1x4", 4),
    Case("wide/k80-1x2", _graph(Wide, 8, 1024, "class"), "k80-1x2", 2),
    Case("mse/p100-2x1", _graph(Mse, 64, 256, "value", 256), "p100-2x1", 2),
    Case("linear/k80-1x4", _graph(Linear, 64, 64, "class"), "k80-1x4", 4),
)
