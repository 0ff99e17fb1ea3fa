import operator

import pytest
import torch
import torch.nn as nn

from soapsearch._fx.base import ALIAS, adapter_for
from soapsearch.trace import _propagate, _symbolic_trace, trace
from strategies.graph import Dim, OpNode, TensorSpec, Weight
from strategies.region import full_box
from strategies.rules import get_rule
from strategies.rules.shape import flat_to_box, view_groups
from tests.strategies.rulecheck import check_model

SHAPE = {"reshape", "flatten", "permute", "slice", "concat", "parameter", "elementwise"}


class Flattens(nn.Module):
    """Flattening a conv-shaped [N, C, H, W] = [4, 6, 4, 4] tensor every way."""

    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()

    def forward(self, x):
        return (self.flat(x), torch.flatten(x, 1), x.flatten(2), x.view(x.size(0), -1),
                x.flatten(0, 1), x.reshape(x.size(0), 6, 2, 8).unsqueeze(2).squeeze(2))


def test_flatten_reproduces_output_and_checks_rows():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 4, 4)
    graph = trace(Flattens(), (x,))
    node, rule = graph["flat"], get_rule("flatten")
    assert node.kind == "flatten" and node.attrs == {} and node.input_specs[0].shape == (4, 6, 4, 4)
    assert rule.splittable(node) == (True, True)
    assert [(d.name, d.role) for d in node.dims] == [("sample", "sample"), ("d1", "attribute")]
    for d in (2, 3, 6, 12, 24):  # pieces of 96 that are whole rows of [6, 4, 4]
        assert rule.check_degrees(node, (1, d)) is None, d
    assert rule.check_degrees(node, (1, 4)) == (
        "op 'flat': degree 4 on output dim 1 (96) of the reshape of input dims [1, 2, 3] "
        "[6, 4, 4] into output dims [1] [96]: piece 0 [0, 24) does not fall on whole rows of the input")
    assert "piece 1 [12, 24)" in rule.check_degrees(node, (1, 8))
    assert rule.input_regions(node, ((0, 2), (48, 56))) == (((0, 2), (3, 4), (0, 2), (0, 4)),)
    assert graph["view"].kind == "reshape" and graph["flatten_2"].dims[0].role == "sample"
    assert check_model(Flattens(), [x], SHAPE, count=16) >= 100


class Heads(nn.Module):
    """[B, T, C] -> [B, T, h, d] -> transpose(1, 2) -> ... -> back to [B, T, C]."""

    def __init__(self, C=12, h=3):
        super().__init__()
        self.h, self.fc = h, nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.size(0), x.size(1), x.size(2)
        q = self.fc(x).view(B, T, self.h, C // self.h).transpose(1, 2)  # [B, h, T, d]
        y = (q * 2).transpose(1, 2).contiguous().view(B, T, C)
        return y, q.permute(0, 2, 3, 1), torch.transpose(q, 1, 3), q.mT.reshape(B, -1, T)


def test_heads_reshape_permute_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 12)
    graph = trace(Heads(), (x,))
    split, merge, rule = graph["view"], graph["view_1"], get_rule("reshape")
    assert rule.splittable(split) == (True, True, True, False)  # d is the inner dim of C
    assert "output dim 3 (4) is an inner dim" in rule.check_degrees(split, (1, 1, 1, 2))
    assert rule.splittable(merge) == (True, True, True)
    assert rule.check_degrees(merge, (1, 1, 3)) is None and rule.check_degrees(merge, (1, 1, 6)) is None
    assert "degree 4 on output dim 2 (12)" in rule.check_degrees(merge, (1, 1, 4))
    perm = graph["transpose"]
    assert perm.kind == "permute" and tuple(perm.attrs["perm"]) == (0, 2, 1, 3)
    assert get_rule("permute").splittable(perm) == (True,) * 4
    assert get_rule("permute").input_regions(perm, ((0, 2), (1, 2), (0, 3), (2, 4))) == (
        ((0, 2), (0, 3), (1, 2), (2, 4)),)
    assert sum(n.kind == "permute" for n in graph) == 5
    assert check_model(Heads(), [x], SHAPE - {"elementwise"}, count=16) >= 110


class LogitsView(nn.Module):
    """view(-1, V) of [B, T, V] logits, and [B*T, V] -> [B, T, V] back (a split group)."""

    def __init__(self, V=8):
        super().__init__()
        self.fc = nn.Linear(8, V)

    def forward(self, x, targets):
        flat = self.fc(x).view(-1, self.fc.out_features)
        return flat.view(x.size(0), x.size(1), -1) * 1, targets.view(-1), x[:, :, None, :].squeeze(-2)


def test_logits_view_reproduces_output():
    torch.manual_seed(0)
    ins = [torch.randn(4, 6, 8), torch.randint(0, 8, (4, 6))]
    graph = trace(LogitsView(), tuple(ins))
    flat, back, rule = graph["view"], graph["view_1"], get_rule("reshape")
    assert [(d.name, d.role) for d in flat.dims] == [("sample", "sample"), ("d1", "attribute")]
    assert rule.splittable(flat) == (True, True)
    for d in (2, 4, 8):  # 24 rows of [4, 6]: pieces of 12, 6 and 3 rows are boxes
        assert rule.check_degrees(flat, (d, 1)) is None
    assert "piece 0 [0, 8)" in rule.check_degrees(flat, (3, 1))
    assert rule.input_regions(flat, ((9, 12), (0, 8))) == (((1, 2), (3, 6), (0, 8)),)
    assert rule.splittable(back) == (True, False, True)
    assert rule.input_regions(back, ((2, 4), (0, 6), (4, 8))) == (((12, 24), (4, 8)),)
    assert view_groups((4, 6, 8), (24, 8)) == [((0, 1), (0,)), ((2,), (1,))]
    assert view_groups((1, 6, 1), (2, 3)) == [((0,), ()), ((1,), (0, 1)), ((2,), ())]
    assert flat_to_box(8, 16, (6, 4)) == ((2, 4), (0, 4)) and flat_to_box(6, 12, (6, 4)) is None
    assert check_model(LogitsView(), ins, {"reshape"}, count=16) >= 32


class Slices(nn.Module):
    def __init__(self, S=4):
        super().__init__()
        self.S = S

    def forward(self, x):
        T = x.size(1)
        return (x[:, -1], x[:, 2:], x[:, :self.S], x[:, 1:T - 1:2], x[..., ::2], x[:, None, -4:-1],
                x[1:3, 5, ...], x[:, :, None][..., 3], x[:2, -100:100])


def test_slices_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 6)
    graph = trace(Slices(), (x,))
    rule = get_rule("slice")
    assert all(n.kind == "slice" for n in graph if n.name != "x")
    last = graph["getitem"]
    assert tuple(last.attrs["index"]) == ((0, 4, 1), 7, (0, 6, 1))
    assert rule.splittable(last) == (True, True) and last.dims[0].role == "sample"
    stride = graph["getitem_3"]  # x[:, 1:7:2]
    assert rule.input_regions(stride, ((0, 4), (1, 3), (0, 6))) == (((0, 4), (3, 6), (0, 6)),)
    assert tuple(graph["getitem_5"].attrs["index"]) == ((0, 4, 1), None, (4, 7, 1), (0, 6, 1))
    assert check_model(Slices(), [x], {"slice"}, count=16) >= 110


class Concats(nn.Module):
    def __init__(self):
        super().__init__()
        self.extra = nn.Parameter(torch.randn(2, 6, 4))

    def forward(self, x, y):
        a = torch.cat([x, y, x[:, :2]], dim=1)  # 4 + 2 + 2 = 8 rows on dim 1
        b = torch.cat((x, self.extra), 0)  # [4 + 2, 6, 4]
        c = torch.concat([x[:, :2], y], dim=-1)
        return a, b, c, torch.cat([x])


def test_concat_reproduces_output():
    torch.manual_seed(0)
    ins = [torch.randn(4, 4, 4), torch.randn(4, 2, 4)]
    ins[0] = torch.randn(4, 4, 4)
    model = Concats()
    model.extra = nn.Parameter(torch.randn(2, 4, 4))
    graph = trace(model, tuple(ins))
    cat, rule = graph["cat"], get_rule("concat")
    assert cat.kind == "concat" and cat.attrs["dim"] == 1 and cat.inputs == ("x", "y", "getitem")
    assert rule.splittable(cat) == (True, True, True)
    assert rule.input_regions(cat, ((0, 2), (2, 6), (0, 4))) == (
        ((0, 2), (2, 4), (0, 4)), ((0, 2), (0, 2), (0, 4)), None)
    assert graph["concat"].attrs["dim"] == 2 and graph["cat_1"].inputs == ("x", "extra")
    assert "cat_2" not in graph  # a cat of one tensor is that tensor
    extra = graph["extra"]
    assert extra.kind == "parameter" and [(d.name, d.role) for d in extra.dims] == [
        ("d0", "parameter"), ("d1", "parameter"), ("d2", "parameter")]
    assert get_rule("parameter").weight_regions(extra, ((0, 1), (0, 4), (2, 4))) == {
        "value": ((0, 1), (0, 4), (2, 4))}
    assert check_model(model, ins, {"concat", "parameter"}, count=16) >= 55


def test_getitem_of_a_tuple_output_is_an_alias():
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 6, batch_first=True)

        def forward(self, x):
            out, (h, c) = self.lstm(x)
            return out, h
    gm = _symbolic_trace(Recurrent())
    _propagate(gm, [torch.randn(2, 3, 4)], count_flops=True)
    items = {(n.args[0].name, n.args[1]): n for n in gm.graph.nodes if n.target is operator.getitem}
    assert set(items) == {("lstm", 0), ("lstm", 1), ("getitem_1", 0), ("getitem_1", 1)}
    op = adapter_for(items["lstm", 0], gm)()
    assert op.kind == ALIAS and op.inputs[0].name == "lstm"
    assert adapter_for(items["lstm", 1], gm)() is None  # (h, c): not the module's output
    assert adapter_for(items["getitem_1", 0], gm)() is None  # h: an item of an item


def test_advanced_indexing_is_opaque():
    class Gather(nn.Module):
        def forward(self, x, idx):
            return x[idx], x[:, idx], x[idx, 1:]
    graph = trace(Gather(), (torch.randn(4, 6), torch.tensor([0, 2])))
    # x[idx] indexes dim 0 by one integer tensor: an "index" op (strategies/rules/gather.py)
    assert [n.kind for n in graph if n.name.startswith("getitem")] == ["index", "opaque", "opaque"]


def test_input_and_constant_leaves():
    graph = trace(nn.Sequential(), (torch.randn(4, 6),))
    x, rule = graph["input_1"], get_rule("input")
    assert [(d.name, d.role) for d in x.dims] == [("sample", "sample"), ("d1", "attribute")]
    assert rule.splittable(x) == (True, True) and rule.input_regions(x, ((0, 2), (0, 6))) == ()
    with pytest.raises(RuntimeError, match="the executor slices the user's batch"):
        rule.forward(x, full_box((4, 6)), [], {})
    spec = TensorSpec((4, 6), "float32")
    const = OpNode("mask", "constant", (), spec, (Dim("d0", 4, "parameter"), Dim("d1", 6, "parameter")),
                   (Weight("value", "mask", spec, trainable=False),))
    crule, value = get_rule("constant"), torch.arange(24.0).view(4, 6)
    assert crule.splittable(const) == (True, True) and crule.input_regions(const, ((0, 2), (0, 3))) == ()
    region = crule.weight_regions(const, ((2, 4), (3, 6)))["value"]
    assert region == ((2, 4), (3, 6))
    assert torch.equal(crule.forward(const, region, [], {"value": value[2:4, 3:6]}), value[2:4, 3:6])


class Views(nn.Module):
    """Reshapes that split, merge and keep dims: conv-shaped and heads-shaped."""

    def forward(self, x, y):
        return (x.flatten(1), x.flatten(0, 1), x.reshape(4, 6, 2, 8), x.view(24, 16),
                y.view(2, 8, 3, 4), y.reshape(16, 12), y.view(2, 96), y.view(2, 8, 3, 4).flatten(2))


def _unmemoized_input_region(node: OpNode, box) -> tuple | None:
    """The reshape rule's input region group by group, recomputed (None: not a box of the input)."""
    from strategies.rules.shape import _group_region

    src, dst = node.input_specs[0].shape, node.shape
    region = [(0, s) for s in src]
    for group in view_groups(src, dst):
        sub = _group_region(src, dst, group, box)
        if sub is None:
            return None
        for i, r in zip(group[0], sub):
            region[i] = r
    return tuple(region)


def test_reshape_input_regions_memoized_per_group_equal_the_rule_recomputed_on_random_boxes():
    import random

    graph = trace(Views(), (torch.randn(4, 6, 4, 4), torch.randn(2, 8, 12)))
    nodes = [n for n in graph if n.kind in ("reshape", "flatten")]
    assert len(nodes) >= 8
    rng, rule, boxes, regions = random.Random(0), get_rule("reshape"), 0, 0
    for node in nodes:
        for _ in range(300):
            box = []
            for s in node.shape:
                a = rng.randrange(s)
                box.append((a, rng.randrange(a + 1, s + 1)))
            box = tuple(box)
            want = _unmemoized_input_region(node, box)
            for _ in range(2):  # the second call reads the memo
                if want is None:
                    with pytest.raises(ValueError, match="is not a box of its input"):
                        rule.input_regions(node, box)
                else:
                    assert rule.input_regions(node, box) == (want,), (node.name, box)
            boxes += 1
            regions += want is not None
    assert regions > 300 and boxes - regions > 300  # both outcomes covered
