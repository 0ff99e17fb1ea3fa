"""Ground truth of the slices a split, chunk, tensor_split or unbind becomes: every partition of
every item computed from only the region the slice rule names equals its piece of the real
output, on random degree grids (rulecheck)."""

import torch
import torch.nn as nn

from soapsearch.trace import trace
from strategies.rules import get_rule
from tests.strategies.rulecheck import check_model


class Splits(nn.Module):
    """Every multi-output form on an [N, 6, 12] tensor, each item read through one op."""

    def forward(self, x):
        a, b, c = x.split(4, dim=2)  # 4 + 4 + 4
        d, e = torch.split(x, [2, 4], dim=1)  # a list of sizes
        f, g, _ = x.split(5, dim=-1)  # 5 + 5 + 2, the last never read
        h = torch.split(x, 100, dim=1)[0]  # split_size beyond the dim: one item, the whole dim
        i, j, k = x.chunk(3, dim=-1)
        l, m = torch.chunk(x, 2, dim=1)
        n, o = x[:, :5].chunk(2, dim=1)  # 5 rows in chunks of 3: the last is short (2)
        p, q, r = torch.tensor_split(x, 3, dim=1)
        s, t, u, w = x.tensor_split(4, dim=2)
        y0, y1 = x.tensor_split([5], dim=2)
        z0, z1, z2 = x.split_with_sizes([3, 3, 6], dim=-1)
        rows = x.unbind(1)
        cols = torch.unbind(x, dim=-1)
        items = (a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, w, y0, y1, z0, z1,
                 z2, rows[0], rows[5], rows[-2], cols[3], cols[11])
        return tuple(it * 2 for it in items)


def test_every_split_form_is_a_slice_per_item():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 12)
    graph = trace(Splits(), (x,))
    assert {n.kind for n in graph} == {"input", "slice", "elementwise"}
    full0, full1, full2 = [0, 4, 1], [0, 6, 1], [0, 12, 1]
    items = [graph[n.inputs[0]].attrs["index"] for n in graph if n.kind == "elementwise"]
    want = [
        [full0, full1, [0, 4, 1]], [full0, full1, [4, 8, 1]], [full0, full1, [8, 12, 1]],
        [full0, [0, 2, 1], full2], [full0, [2, 6, 1], full2],
        [full0, full1, [0, 5, 1]], [full0, full1, [5, 10, 1]],
        [full0, full1, full2],
        [full0, full1, [0, 4, 1]], [full0, full1, [4, 8, 1]], [full0, full1, [8, 12, 1]],
        [full0, [0, 3, 1], full2], [full0, [3, 6, 1], full2],
    ]
    assert [list(map(_plain, it)) for it in items[:len(want)]] == want
    n_item, o_item = items[13], items[14]  # chunks of x[:, :5]: rows [0, 3) and [3, 5)
    assert _plain(n_item[1]) == [0, 3, 1] and _plain(o_item[1]) == [3, 5, 1]
    assert [_plain(it[1]) for it in items[15:18]] == [[0, 2, 1], [2, 4, 1], [4, 6, 1]]
    assert [_plain(it[2]) for it in items[18:22]] == [[0, 3, 1], [3, 6, 1], [6, 9, 1], [9, 12, 1]]
    assert [_plain(it[2]) for it in items[22:24]] == [[0, 5, 1], [5, 12, 1]]
    assert [_plain(it[2]) for it in items[24:27]] == [[0, 3, 1], [3, 6, 1], [6, 12, 1]]
    assert [it[1] for it in items[27:30]] == [0, 5, 4]  # unbind(1): an int drops the dim
    assert [it[2] for it in items[30:32]] == [3, 11]
    assert graph[next(n.inputs[0] for n in graph if n.kind == "elementwise")].dims[0].role == "sample"
    # the unread third item of split(5, -1) and unbind's unread rows make no op
    assert sum(n.kind == "slice" for n in graph) == 33  # 32 items + x[:, :5]
    rule = get_rule("slice")
    row = graph[[n for n in graph if n.kind == "elementwise"][28].inputs[0]]  # rows[5]: [4, 12]
    assert row.shape == (4, 12)
    assert rule.input_regions(row, ((2, 4), (6, 9))) == (((2, 4), (5, 6), (6, 9)),)
    assert check_model(Splits(), [x], {"slice"}, count=6) >= 180


def _plain(entry):
    return list(entry) if isinstance(entry, (list, tuple)) else entry


class FusedHeads(nn.Module):
    """A fused qkv projection cut by heads, every way a model may write it."""

    def __init__(self, C=12, H=3):
        super().__init__()
        self.c_attn, self.C, self.H = nn.Linear(C, 3 * C), C, H

    def forward(self, x):
        B, T = x.size(0), x.size(1)
        qkv = self.c_attn(x)
        q, k, v = qkv.split(self.C, dim=2)
        q2, k2, v2 = qkv.view(B, T, 3, self.H, self.C // self.H).permute(2, 0, 3, 1, 4).unbind(0)
        q3, _, v3 = qkv.chunk(3, dim=-1)
        return q @ k.transpose(1, 2), q2 @ k2.transpose(-2, -1) + v2.sum(), v + q3 * v3


def test_fused_qkv_items_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(4, 5, 12)
    graph = trace(FusedHeads(), (x,))
    slices = [n for n in graph if n.kind == "slice"]
    assert len(slices) == 3 + 3 + 2  # chunk's k is never read
    assert all(n.inputs == ("c_attn",) for n in slices[:3] + slices[6:])
    unbound = slices[3:6]
    assert [n.shape for n in unbound] == [(4, 3, 5, 4)] * 3
    assert [n.attrs["index"][0] for n in unbound] == [0, 1, 2]
    assert check_model(FusedHeads(), [x], {"slice"}, count=12) >= 80
