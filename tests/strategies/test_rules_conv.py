"""Ground truth of the conv2d, pool2d and adaptive_pool2d rules: every partition computed from
only the halo regions its rule names equals its slice of the real output."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.rules import get_rule
from tests.strategies.rulecheck import check_model

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")

WINDOW = {"conv2d", "pool2d", "adaptive_pool2d"}


def _check(model, x, count, kinds=WINDOW):
    torch.manual_seed(0)
    return check_model(model, [x], kinds, count=count)


def _op(model, x, kind, wrap=True):
    graph = trace(nn.Sequential(model) if wrap else model, (x,))  # fx traces through a bare module
    return next(n for n in graph if n.kind == kind)


class ConvStack(nn.Module):
    """Stride 2, padding, dilation, grouped, depthwise, 1x1 and asymmetric kernels."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=1, padding=1)
        self.down = nn.Conv2d(8, 12, 3, stride=2, padding=1, bias=False)
        self.dil = nn.Conv2d(12, 12, 3, padding=2, dilation=2)
        self.grouped = nn.Conv2d(12, 24, 3, padding=1, groups=3)
        self.depthwise = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.point = nn.Conv2d(24, 8, 1)
        self.wide = nn.Conv2d(8, 8, (1, 5), padding=(0, 2))
        self.tall = nn.Conv2d(8, 8, (3, 1), stride=(2, 1), padding=(1, 0))

    def forward(self, x):
        for m in (self.stem, self.down, self.dil, self.grouped, self.depthwise, self.point,
                  self.wide, self.tall):
            x = m(x)
        return x


def test_conv_stack_regions_reproduce_output():
    assert _check(ConvStack(), torch.randn(4, 3, 16, 16), count=12) >= 8 * 12


class OddConvs(nn.Module):
    """'same' with an even kernel (asymmetric padding: 1 before, 2 after) and with dilation,
    'valid', a padding larger than the kernel (partitions that read only padding), stride 3
    with a remainder."""

    def __init__(self):
        super().__init__()
        self.same = nn.Sequential(nn.Conv2d(4, 4, 4, padding="same"),
                                  nn.Conv2d(4, 6, 4, padding="same", dilation=2))
        self.valid = nn.Conv2d(6, 6, 3, padding="valid")
        self.pad = nn.Conv2d(6, 4, 1, padding=2)
        self.stride3 = nn.Conv2d(4, 4, 2, stride=3, padding=1)

    def forward(self, x):
        return self.stride3(self.pad(self.valid(self.same(x))))


def test_string_and_large_padding():
    assert _check(OddConvs(), torch.randn(4, 4, 14, 14), count=12) >= 5 * 9
    dilated = [n for n in trace(OddConvs(), (torch.randn(2, 4, 14, 14),)) if n.kind == "conv2d"][1]
    assert dilated.attrs["padding"] == (3, 3) and dilated.attrs["padding_hi"] == (3, 3)
    asym = _op(nn.Conv2d(4, 4, 4, padding="same"), torch.randn(2, 4, 8, 8), "conv2d")
    assert asym.attrs["padding"] == (1, 1) and asym.attrs["padding_hi"] == (2, 2)
    edge = _op(nn.Conv2d(4, 4, 1, padding=2), torch.randn(2, 4, 8, 8), "conv2d")
    assert get_rule("conv2d").input_regions(edge, ((0, 2), (0, 4), (0, 2), (0, 12), (0, 4)))[0] is None


class PaddingModes(nn.Module):
    def __init__(self):
        super().__init__()
        self.reflect = nn.Conv2d(3, 6, 3, padding=1, padding_mode="reflect")
        self.circular = nn.Conv2d(6, 6, 3, stride=2, padding=2, padding_mode="circular")
        self.replicate = nn.Conv2d(6, 4, 4, padding="same", padding_mode="replicate")

    def forward(self, x):
        return self.replicate(self.circular(self.reflect(x)))


def test_padding_modes_keep_spatial_dims_whole():
    assert _check(PaddingModes(), torch.randn(4, 3, 12, 12), count=8) >= 3 * 7
    node = _op(PaddingModes(), torch.randn(4, 3, 12, 12), "conv2d")
    assert get_rule("conv2d").splittable(node) == (True, True, False, False, True)


class FunctionalConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 2, 3, 3) * 0.3)
        self.b = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.conv2d(x, self.w, self.b, stride=1, padding=1, groups=2)


def test_functional_conv_takes_weight_as_input():
    assert _check(FunctionalConv(), torch.randn(4, 4, 8, 8), count=12) >= 12
    node = _op(FunctionalConv(), torch.randn(4, 4, 8, 8), "conv2d", wrap=False)
    assert node.attrs["param_inputs"] == ("weight", "bias") and node.inputs[1:] == ("w", "b")


def test_conv_dims_and_group_degrees():
    node = _op(nn.Conv2d(12, 12, 3, padding=1, groups=3), torch.randn(4, 12, 8, 8), "conv2d")
    assert [(d.name, d.role) for d in node.dims] == [
        ("sample", "sample"), ("channel", "parameter"), ("height", "attribute"), ("width", "attribute"),
        ("in_channels", "reduction")]
    rule = get_rule("conv2d")
    assert rule.splittable(node) == (True, True, True, True, True)
    assert rule.check_degrees(node, (1, 3, 1, 1, 1)) is None  # whole groups
    assert rule.check_degrees(node, (1, 6, 1, 1, 1)) is None  # halves of a group
    for bad in (2, 4):
        msg = rule.check_degrees(node, (1, bad, 1, 1, 1))
        assert msg is not None and f"degree {bad} on dim 'channel'(12)" in msg
        assert "divide 3 or be a multiple of it" in msg
    box = ((0, 4), (4, 6), (2, 4), (0, 8), (0, 12))
    x, = rule.input_regions(node, box)
    assert x == ((0, 4), (4, 8), (1, 5), (0, 8))
    assert rule.weight_regions(node, box) == {"weight": ((4, 6), (0, 4), (0, 3), (0, 3)), "bias": ((4, 6),)}


class Reducing(nn.Module):
    """Convs whose in channels may be cut (groups=1): a stem with bias, a strided one without,
    a functional one with a bias input, and a grouped one after them (its in channels stay whole)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 6, 3, padding=1)
        self.down = nn.Conv2d(6, 4, 3, stride=2, padding=1, bias=False)
        self.w, self.b = nn.Parameter(torch.randn(6, 4, 1, 1) * 0.3), nn.Parameter(torch.randn(6))
        self.grouped = nn.Conv2d(6, 6, 3, padding=1, groups=2)

    def forward(self, x):
        return self.grouped(F.conv2d(self.down(self.stem(x)), self.w, self.b))


def test_in_channels_cut_sums_to_the_conv():
    """The sum of the Partial outputs of an in_channels cut (every grid with one, random ones
    with it times the other dims) equals the unsplit conv; the bias is read once."""
    x = torch.randn(4, 4, 8, 8)
    graph = trace(Reducing(), (x,))
    convs = [n for n in graph if n.kind == "conv2d"]
    rule = get_rule("conv2d")
    assert [n.dims[4].name for n in convs] == ["in_channels"] * 4
    assert [n.shape[4] for n in convs] == [4, 6, 4, 6]
    torch.manual_seed(0)
    assert check_model(Reducing(), [x], {"conv2d"}, count=30) >= 4 * 20
    stem = convs[0]
    from strategies.config import enumerate_configs
    assert {c.degrees for c in enumerate_configs(stem, 4)} >= {(1, 1, 1, 1, 2), (1, 1, 1, 1, 4), (2, 1, 1, 1, 2)}
    assert rule.weight_regions(stem, ((0, 4), (0, 6), (0, 8), (0, 8), (2, 4))) == {
        "weight": ((0, 6), (2, 4), (0, 3), (0, 3))}
    assert rule.weight_regions(stem, ((0, 4), (3, 6), (0, 8), (0, 8), (0, 2))) == {
        "weight": ((3, 6), (0, 2), (0, 3), (0, 3)), "bias": ((3, 6),)}
    assert rule.input_regions(stem, ((0, 2), (0, 6), (0, 4), (0, 8), (2, 4)))[0] == ((0, 2), (2, 4), (0, 5), (0, 8))
    functional = convs[2]
    assert functional.attrs["param_inputs"] == ("weight", "bias")
    assert rule.input_regions(functional, ((0, 4), (0, 6), (0, 4), (0, 4), (2, 4)))[1:] == (
        ((0, 6), (2, 4), (0, 1), (0, 1)), None)  # no bias where the in channels start past 0


def test_grouped_conv_refuses_an_in_channels_cut():
    from strategies.config import ParallelConfig, enumerate_configs, validate_config
    from strategies.errors import PlanError
    node = [n for n in trace(Reducing(), (torch.randn(4, 4, 8, 8),)) if n.kind == "conv2d"][-1]
    assert not any(c.degrees[4] > 1 for c in enumerate_configs(node, 4))
    with pytest.raises(PlanError, match=r"^op 'grouped': degrees = \[1, 1, 1, 1, 2\]: op 'grouped': degree 2 on dim "
                       r"'in_channels'\(6\) of a conv with 2 groups: only a conv with groups=1"):
        validate_config(node, ParallelConfig((1, 1, 1, 1, 2), (0, 1)), 2)


class Pools(nn.Module):
    """maxpool 3/2/1, a torchvision inception branch's avg_pool2d(3, 1, 1), dilation, ceil_mode
    max (exact with -inf), divisor_override and the functional forms."""

    def __init__(self):
        super().__init__()
        self.max = nn.MaxPool2d(3, 2, 1)
        self.dilated = nn.MaxPool2d(3, 1, 1, dilation=2)
        self.avg = nn.AvgPool2d(2)
        self.ceil = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.div = nn.AvgPool2d(3, 1, 1, divisor_override=4)

    def forward(self, x):
        x = F.avg_pool2d(self.max(x), 3, 1, 1)
        x = self.avg(self.dilated(x))
        x = F.max_pool2d(x, kernel_size=2, stride=1, padding=1)
        return self.div(self.ceil(torch.relu(x)))


def test_pools_regions_reproduce_output():
    assert _check(Pools(), torch.randn(4, 6, 32, 32), count=14, kinds={"pool2d"}) >= 7 * 12


class InexactPools(nn.Module):
    def __init__(self):
        super().__init__()
        self.excl = nn.AvgPool2d(3, 2, 1, count_include_pad=False)
        self.ceil = nn.AvgPool2d(3, 2, ceil_mode=True)
        self.full = nn.AvgPool2d(2, ceil_mode=True)  # no partial window: still exact

    def forward(self, x):
        return self.full(self.ceil(self.excl(x)))


def test_inexact_pools_keep_spatial_dims_whole():
    model, x = InexactPools(), torch.randn(4, 6, 16, 16)
    assert _check(model, x, count=8, kinds={"pool2d"}) >= 3 * 5
    rule = get_rule("pool2d")
    split = [rule.splittable(n) for n in trace(model, (x,)) if n.kind == "pool2d"]
    assert split == [(True, True, False, False), (True, True, False, False), (True, True, True, True)]


def test_pool_dims_and_regions():
    node = _op(nn.MaxPool2d(3, 2, 1), torch.randn(4, 6, 16, 16), "pool2d")
    assert [(d.name, d.role) for d in node.dims] == [
        ("sample", "sample"), ("channel", "attribute"), ("height", "attribute"), ("width", "attribute")]
    assert node.attrs["kernel"] == (3, 3) and node.attrs["stride"] == (2, 2)
    # rows [4, 8) read [4*2 - 1, 7*2 - 1 + 3) = [7, 16); rows [0, 4) read [-1, 8) -> [0, 8)
    assert get_rule("pool2d").input_regions(node, ((0, 4), (0, 6), (4, 8), (0, 4)))[0] == \
        ((0, 4), (0, 6), (7, 16), (0, 8))
    idx = _op(nn.MaxPool2d(2, return_indices=True), torch.randn(4, 6, 8, 8), "pool2d")
    assert get_rule("pool2d").splittable(idx) == (True, True, False, False)


class Adaptive(nn.Module):
    def __init__(self):
        super().__init__()
        self.regular = nn.AdaptiveAvgPool2d((6, 4))
        self.ragged = nn.AdaptiveMaxPool2d(4)
        self.glob = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        a = self.regular(x)  # 12x12 -> 6x4: regular bins
        b = self.ragged(a)  # 6x4 -> 4x4: ragged rows, regular cols
        c = F.adaptive_avg_pool2d(x, (4, None))
        return self.glob(b) + self.glob(c)


def test_adaptive_pools_regions_reproduce_output():
    model, x = Adaptive(), torch.randn(4, 8, 12, 12)
    assert _check(model, x, count=12, kinds={"adaptive_pool2d"}) >= 4 * 8
    rule = get_rule("adaptive_pool2d")
    nodes = [n for n in trace(model, (x,)) if n.kind == "adaptive_pool2d"]
    assert [rule.splittable(n) for n in nodes] == [
        (True, True, True, True), (True, True, False, True), (True, True, True, True),
        (True, True, True, True), (True, True, True, True)]
    assert rule.input_regions(nodes[0], ((0, 4), (0, 8), (3, 6), (0, 2)))[0] == \
        ((0, 4), (0, 8), (6, 12), (0, 6))
