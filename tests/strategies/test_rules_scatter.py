"""The slice_scatter rule (``x`` with a slab replaced by ``src``: what torch.export's
functionalization makes of ``x[:, 2:5] = y`` and ``x[:, 0] = v``), checked against real
arithmetic: every partition of random degree grids computed from only the regions it reads."""

import torch
import torch.nn as nn

from soapsearch.trace import trace
from strategies.rules import get_rule
from tests.strategies.rulecheck import check_model


class Scatters(nn.Module):
    """Slabs of x [4, 6, 8] replaced every way: rows of an inner dim, one row (select), rows of
    the batch dim, a negative index, the last rows."""

    def forward(self, x, y, v):
        return (torch.slice_scatter(x, y, 1, 2, 5),         # y [4, 3, 8] into rows 2..4 of dim 1
                torch.select_scatter(x, v, 1, 4),           # v [4, 8] into row 4 of dim 1
                torch.slice_scatter(x, x[:2] * 2, 0, 2),    # rows 2..3 of the batch dim
                torch.select_scatter(x, x[:, :, 0] + 1, 2, -1),
                torch.slice_scatter(x, y[:, :2], dim=1, start=4))


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 6, 8), torch.randn(4, 3, 8), torch.randn(4, 8)]


def test_scatter_ops_and_their_regions():
    graph = trace(Scatters(), _inputs())
    ops = [n for n in graph if n.kind == "slice_scatter"]
    assert [dict(n.attrs) for n in ops] == [
        {"dim": 1, "start": 2, "stop": 5, "select": False},
        {"dim": 1, "start": 4, "stop": 5, "select": True},
        {"dim": 0, "start": 2, "stop": 4, "select": False},
        {"dim": 2, "start": 7, "stop": 8, "select": True},
        {"dim": 1, "start": 4, "stop": 6, "select": False}]
    rule = get_rule("slice_scatter")
    rows, one = ops[0], ops[1]
    assert rule.splittable(rows) == (True, True, True)
    assert [d.role for d in rows.dims] == ["sample", "attribute", "attribute"]
    # dim 1 cut in 3: [0, 2) reads no src, [2, 4) reads src rows [0, 2), [4, 6) src row [2, 3)
    assert rule.input_regions(rows, ((0, 4), (0, 2), (0, 8))) == (((0, 4), (0, 2), (0, 8)), None)
    assert rule.input_regions(rows, ((0, 2), (2, 4), (4, 8))) == (
        ((0, 2), (2, 4), (4, 8)), ((0, 2), (0, 2), (4, 8)))
    assert rule.input_regions(rows, ((0, 4), (4, 6), (0, 8)))[1] == ((0, 4), (2, 3), (0, 8))
    # a select's src lacks the dim: a box holding row 4 reads src's box of the other dims
    assert rule.input_regions(one, ((2, 4), (3, 6), (0, 4))) == (
        ((2, 4), (3, 6), (0, 4)), ((2, 4), (0, 4)))
    assert rule.input_regions(one, ((0, 4), (0, 3), (0, 8)))[1] is None


def test_scatter_partitions_reproduce_the_output():
    assert check_model(Scatters(), _inputs(), {"slice_scatter"}, count=16) == 5 * 16


class WholeAndStrided(nn.Module):
    def forward(self, x, y):
        return (torch.slice_scatter(x, y, 1, 0, None) * 2,
                torch.slice_scatter(x, y[:, :3], 1, 0, 6, 2))


def test_a_whole_dim_is_its_source_and_a_step_is_opaque():
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    graph = trace(WholeAndStrided(), (x, y))
    mul = next(n for n in graph if n.kind == "elementwise")
    assert mul.inputs == ("y",)  # slice_scatter of all of dim 1: y itself
    assert [n.kind for n in graph if n.inputs == ("x", "getitem")] == ["opaque"]
