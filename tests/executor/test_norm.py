"""Batchnorm in the executor (soapsearch/executor/norm.py) on a gloo world of one process, in
this process: the partition alone (torch's F.batch_norm, which keeps the running statistics)
with momentum None continuing from a loaded num_batches_tracked, and the split-batch algorithm
(one all-reduce each way) against F.batch_norm, float64."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.executor import Executor, TrainConfig
from soapsearch.executor.norm import batch_norm
from soapsearch.trace import trace
from strategies.baselines import data_parallel
from tests.executor.reference import reference_train


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(torch.relu(self.bn(self.conv(x))).flatten(1)), y)


def test_cumulative_running_statistics_continue_from_a_loaded_count(world_of_one):
    torch.manual_seed(0)
    model = ConvBN().double()
    inputs = (torch.randn(6, 3, 6, 6, dtype=torch.float64) * 2 + 1, torch.randint(0, 5, (6,)))
    model.bn.momentum = None
    graph = trace(model, inputs)
    assert next(n for n in graph if n.kind == "batchnorm2d").attrs["momentum"] is None
    model.bn.num_batches_tracked.fill_(5)
    model.bn.running_mean.uniform_(-1, 1)
    cfg = TrainConfig("sgd", lr=0.05)
    ex = Executor(graph, data_parallel(graph, 1), model.state_dict(), inputs, cfg)
    got = [(ex.step(seed=s), ex.state_dict()) for s in range(2)]
    ref = reference_train(model, inputs, graph, cfg, steps=2)
    for s, (loss, state) in enumerate(got):
        assert loss == pytest.approx(ref["losses"][s], rel=1e-12)
        for k, v in ref["states"][s].items():
            torch.testing.assert_close(state[k], v, rtol=1e-10, atol=1e-12, msg=lambda m: f"step {s} {k}: {m}")
    assert int(got[-1][1]["bn.num_batches_tracked"]) == 7


def test_split_batch_algorithm_equals_batch_norm(world_of_one):
    """The group path (statistics gathered by one all-reduce, SyncBatchNorm's backward) on a
    group of one: output, input/weight/bias gradients and running statistics as F.batch_norm."""
    node = trace(nn.Sequential(nn.BatchNorm2d(3, momentum=0.3)).double(),
                 (torch.randn(2, 3, 4, 4, dtype=torch.float64),))["_0"]
    torch.manual_seed(1)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64) * 3 + 2
    w, b = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    dy = torch.randn_like(x)
    results = []
    for grouped in (True, False):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        stats = {"running_mean": torch.zeros(3, dtype=torch.float64), "running_var": torch.ones(3, dtype=torch.float64)}
        if grouped:
            y = batch_norm(node, xs, {"weight": ws, "bias": bs, **stats}, world_of_one, 1)
        else:
            y = F.batch_norm(xs, stats["running_mean"], stats["running_var"], ws, bs, True, 0.3, node.attrs["eps"])
        y.backward(dy)
        results.append([y, xs.grad, ws.grad, bs.grad, stats["running_mean"], stats["running_var"]])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
