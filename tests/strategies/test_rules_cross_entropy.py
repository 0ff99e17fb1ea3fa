"""Vocab-parallel cross-entropy (``strategies.rules.cross_entropy``) against torch: every
partition of a grid that cuts the classes computes its s_p and c_p from its own logits and
class weights with its class shards' max and sum; Σ s_p / Σ c_p is F.cross_entropy and the
gradients each partition backpropagates into its own logits make torch's gradient."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.config import ParallelConfig, enumerate_configs, validate_config
from strategies.errors import PlanError
from strategies.region import partition_boxes, partition_index, slice_box
from strategies.rules import get_rule
from strategies.rules.cross_entropy import ClassShards
from tests.strategies.rulecheck import _add, _collective, _max


class Loss(nn.Module):
    def __init__(self, classes: int, weighted: bool, **kw):
        super().__init__()
        self.kw = kw
        self.register_buffer("cw", torch.rand(classes, dtype=torch.float64) + 0.5 if weighted else None)

    def forward(self, x, t):
        return F.cross_entropy(x, t, weight=self.cw, **self.kw)


def _split_run(node, degrees, x, t, weight):
    """(L, dL/dx) from the partitions of ``degrees`` (threads; each class group's max and sum
    a collective of its own)."""
    rule = get_rule("loss")
    boxes = partition_boxes(node.shape, degrees)
    c = len(degrees) - 1
    groups: dict[tuple, list[int]] = {}
    for k in range(len(boxes)):
        groups.setdefault(partition_index(k, degrees)[:c], []).append(k)
    shards = {}
    for members in groups.values():
        maxes, sums = _collective(members, _max), _collective(members, _add)
        shards.update({k: ClassShards(maxes[k], sums[k]) for k in members})
    out, leaves = [None] * len(boxes), [None] * len(boxes)

    def run(k):
        rx, rt = rule.input_regions(node, boxes[k])
        leaves[k] = x[slice_box(rx)].detach().clone().requires_grad_()
        ws = {"class_weight": weight[slice_box(r)] for r in rule.weight_regions(node, boxes[k]).values()} \
            if weight is not None else {}
        out[k] = rule.partial(node, boxes[k], [leaves[k], t[slice_box(rt)]], ws, shards[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(boxes))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    s = sum(o[0].detach() for o in out)
    count = 1.0 if node.attrs["reduction"] == "sum" else sum(o[1] for o in out)
    grad = torch.zeros_like(x)
    for k, (sp, _) in enumerate(out):
        (sp / count).backward()
        grad[slice_box(rule.input_regions(node, boxes[k])[0])] += leaves[k].grad
    return s / count, grad


CASES = [
    (dict(), False),
    (dict(reduction="sum"), False),
    (dict(ignore_index=3), False),
    (dict(), True),
    (dict(label_smoothing=0.1), False),
    (dict(label_smoothing=0.2, reduction="sum"), True),
    (dict(label_smoothing=0.3, ignore_index=1), True),
]


@pytest.mark.parametrize("kw,weighted", CASES)
@pytest.mark.parametrize("shape", [(12, 8), (4, 8, 3)])
def test_partitions_make_torch_loss_and_gradient(kw, weighted, shape):
    torch.manual_seed(len(CASES) * len(shape) + int(weighted))
    x = torch.randn(*shape, dtype=torch.float64) * 3
    t = torch.randint(0, shape[1], (shape[0], *shape[2:]))
    t.view(-1)[::5] = kw.get("ignore_index", -100)
    model = Loss(shape[1], weighted, **kw)
    (node,) = [n for n in trace(model, (x, t)) if n.kind == "loss"]
    assert node.dims[-1].name == "classes" and node.reduction_dims == (len(node.dims) - 1,)
    xr = x.clone().requires_grad_()
    want = model(xr, t)
    want.backward()
    grids = [(1, 2), (1, 4), (1, 8), (3, 2), (2, 4)] if len(shape) == 2 else [(1, 1, 2), (2, 1, 4), (1, 3, 2)]
    for degrees in grids:
        got, grad = _split_run(node, degrees, x, t, model.cw)
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12, msg=f"{degrees}")
        torch.testing.assert_close(grad, xr.grad, rtol=1e-10, atol=1e-12, msg=f"{degrees}")


def test_one_shard_counts_the_samples():
    """Shards with lo > 0 output s_p = 0 and c_p = 0 (their gradient only): Σ_p counts each
    sample once."""
    torch.manual_seed(0)
    x, t = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 4, (6,))
    (node,) = [n for n in trace(Loss(4, False), (x, t)) if n.kind == "loss"]
    rule = get_rule("loss")
    sums = _collective([0, 1], _add)
    maxes = _collective([0, 1], _max)
    out = [None, None]

    def run(k):
        box = ((0, 6), (2 * k, 2 * k + 2))
        out[k] = rule.partial(node, box, [x[:, 2 * k:2 * k + 2].requires_grad_(), t], {},
                              ClassShards(maxes[k], sums[k]))

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    (s0, c0), (s1, c1) = out
    assert float(s1.detach()) == 0.0 and float(c1) == 0.0 and s1.requires_grad
    torch.testing.assert_close(s0, F.cross_entropy(x, t, reduction="sum"))
    assert float(c0) == 6.0


def test_class_cut_is_offered_and_checked():
    x, t = torch.randn(8, 6), torch.randint(0, 6, (8,))
    (node,) = [n for n in trace(Loss(6, False), (x, t)) if n.kind == "loss"]
    grids = {c.degrees for c in enumerate_configs(node, 4)}
    assert {(1, 2), (2, 2), (4, 1), (1, 3)} <= grids and (1, 4) not in grids  # 4 does not divide 6
    with pytest.raises(PlanError, match=r"degree 4 on dim 'classes'\(6\) does not divide it"):
        validate_config(node, ParallelConfig((1, 4), (0, 1, 2, 3)), 4)
    assert ParallelConfig((2, 2), (0, 1, 2, 3)).show(node.dims) == "S2·R2 @ 0-3"
