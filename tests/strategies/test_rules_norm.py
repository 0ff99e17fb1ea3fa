"""Ground truth of the batchnorm2d, layernorm, softmax and log_softmax rules: every partition
computed from only the regions its rule names (batch statistics summed across the partitions of
split sample/height/width dims) equals its slice of the real output."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.rules import Reduction, get_rule
from tests.strategies.rulecheck import check_model

NORMS = {"batchnorm2d", "layernorm", "softmax", "log_softmax"}


def _check(model, x, count, kinds=NORMS):
    torch.manual_seed(0)
    return check_model(model, [x], kinds, count=count)


def _ops(model, x, kind):
    return [n for n in trace(model, (x,)) if n.kind == kind]


class ConvBN(nn.Module):
    """conv -> BN -> relu twice, and a BN with neither affine weights nor running stats."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8, eps=1e-3)
        self.bare = nn.BatchNorm2d(8, affine=False, track_running_stats=False)
        for bn in (self.bn1, self.bn2):
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.5, 0.5)
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.bare(x * 3 + 1)


def test_batchnorm_training_sums_batch_statistics():
    model, x = ConvBN(), torch.randn(8, 3, 8, 8) * 2 + 1
    assert _check(model, x, count=24, kinds={"batchnorm2d"}) >= 3 * 24


def test_batchnorm_eval_uses_running_statistics():
    model, x = ConvBN().eval(), torch.randn(8, 3, 16, 16)
    bn = _ops(model, x, "batchnorm2d")
    assert _check(model, x, count=16, kinds={"batchnorm2d"}) >= 3 * 16
    rule = get_rule("batchnorm2d")
    assert rule.reductions(bn[0], (2, 2, 2, 1)) == ()
    # track_running_stats=False normalizes with the batch even in eval
    assert rule.reductions(bn[2], (2, 1, 1, 2)) == (Reduction("batch_stats", (0, 3)),)


def test_batchnorm_dims_weights_and_reductions():
    model, x = ConvBN(), torch.randn(8, 3, 16, 16)
    bn, _, bare = _ops(model, x, "batchnorm2d")
    assert [(d.name, d.role) for d in bn.dims] == [
        ("sample", "sample"), ("channel", "parameter"), ("height", "attribute"), ("width", "attribute")]
    assert [(d.name, d.role) for d in bare.dims][1] == ("channel", "attribute")
    assert [(w.role, w.name, w.trainable) for w in bn.weights] == [
        ("weight", "bn1.weight", True), ("bias", "bn1.bias", True),
        ("running_mean", "bn1.running_mean", False), ("running_var", "bn1.running_var", False)]
    assert bare.weights == () and bare.attrs["track_running_stats"] is False
    rule = get_rule("batchnorm2d")
    assert rule.splittable(bn) == (True, True, True, True)
    assert rule.reductions(bn, (1, 4, 1, 1)) == ()
    assert rule.reductions(bn, (2, 2, 1, 2)) == (Reduction("batch_stats", (0, 3)),)
    assert rule.reductions(bn, (2, 1, 2, 2)) == (Reduction("batch_stats", (0, 2, 3)),)
    box = ((0, 4), (2, 4), (8, 16), (0, 16))
    assert rule.input_regions(bn, box) == (box,)
    assert rule.weight_regions(bn, box) == {r: ((2, 4),) for r in
                                            ("weight", "bias", "running_mean", "running_var")}


def test_batchnorm_forward_matches_torch_training_statistics():
    """One partition computes exactly F.batch_norm in training: two sums, biased variance."""
    model, x = ConvBN(), torch.randn(8, 3, 16, 16)
    bn, rule = _ops(model, x, "batchnorm2d")[0], get_rule("batchnorm2d")
    h = torch.randn(8, 8, 16, 16, dtype=torch.float64) * 2 + 1
    w, b = torch.rand(8, dtype=torch.float64) + 0.5, torch.randn(8, dtype=torch.float64)
    summed = []
    out = rule.forward(bn, ((0, 8), (0, 8), (0, 16), (0, 16)), [h], {"weight": w, "bias": b},
                       lambda t: summed.append(t.shape) or t)
    want = F.batch_norm(h, None, None, w, b, True, 0.0, bn.attrs["eps"])
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    assert summed == [torch.Size([9]), torch.Size([8])]  # channel sums + the count, then squares
    assert "momentum*var*n/(n-1)" in type(rule).__doc__


class Transformerish(nn.Module):
    """LayerNorm over the last dim (pre-norm block) and over the last two dims, functional
    layer_norm with and without parameters, attention-like softmax over -1."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(12)
        self.ln2 = nn.LayerNorm([3, 12], elementwise_affine=False)
        self.ln3 = nn.LayerNorm(12, bias=False)
        self.g = nn.Parameter(torch.rand(12) + 0.5)
        self.b = nn.Parameter(torch.randn(12))
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):  # x: (N, S, D)
        h = self.ln(x)
        att = torch.softmax(h @ h.transpose(1, 2), dim=-1)  # (N, S, S)
        h = F.layer_norm(att @ h + x, (12,), self.g, self.b, eps=1e-6)
        h = self.ln3(F.layer_norm(h, h.shape[-1:]))
        return self.ln2(h.view(-1, 4, 3, 12)) + x.log_softmax(dim=1).view(-1, 4, 3, 12)


def test_layernorm_and_softmax_regions_reproduce_output():
    model, x = Transformerish(), torch.randn(8, 12, 12) * 3
    assert _check(model, x, count=20) >= 70  # 6 ops; the (N, 4) lead dims of ln2 allow 8 grids


def test_layernorm_dims():
    model, x = Transformerish(), torch.randn(8, 12, 12)
    ln, _, _, ln3, ln2 = _ops(model, x, "layernorm")
    assert [(d.name, d.role) for d in ln.dims] == [
        ("sample", "sample"), ("seq", "attribute"), ("features", "parameter")]
    assert [(d.name, d.role) for d in ln2.dims] == [
        ("sample", "sample"), ("seq", "attribute"), ("features0", "parameter"),
        ("features1", "parameter")]
    rule = get_rule("layernorm")
    assert rule.splittable(ln) == (True, True, False)
    assert rule.splittable(ln2) == (True, True, False, False)
    assert [w.role for w in ln.weights] == ["weight", "bias"] and ln2.weights == ()
    assert [w.role for w in ln3.weights] == ["weight"]
    assert ln2.attrs["normalized_shape"] == (3, 12)
    box = ((2, 4), (0, 3), (0, 12))
    assert rule.input_regions(ln, box) == (box,)
    assert rule.weight_regions(ln, box) == {"weight": ((0, 12),), "bias": ((0, 12),)}
    fn = _ops(model, x, "layernorm")[1]
    assert fn.attrs["param_inputs"] == ("weight", "bias") and fn.inputs[1:] == ("g", "b")
    assert rule.input_regions(fn, box) == (box, ((0, 12),), ((0, 12),))


class Classifier(nn.Module):
    """Softmax / log_softmax over classes (dim 1) of logits and of a segmentation map, in every
    spelling: F., torch., the method, the module, with a dtype."""

    def __init__(self):
        super().__init__()
        self.sm, self.lsm = nn.Softmax(dim=1), nn.LogSoftmax(dim=1)

    def forward(self, x):  # x: (N, C, H, W)
        seg = self.sm(x) + F.softmax(x, dim=-1) + x.softmax(2) + self.lsm(x)
        logits = seg.mean((2, 3))
        return (F.log_softmax(logits, 1) + torch.log_softmax(logits, dim=-1)
                + F.softmax(logits, dim=1, dtype=torch.float64) + seg.log_softmax(-3).sum())


def test_softmax_regions_reproduce_output():
    model, x = Classifier(), torch.randn(8, 6, 4, 12)
    assert _check(model, x, count=16, kinds={"softmax", "log_softmax"}) >= 4 * 16 + 4 * 3


def test_softmax_dims_and_attrs():
    model, x = Classifier(), torch.randn(8, 6, 4, 12)
    graph = trace(model, (x,))
    nodes = [n for n in graph if n.kind in ("softmax", "log_softmax")]
    assert [(n.kind, n.attrs["dim"]) for n in nodes] == [
        ("softmax", 1), ("softmax", 3), ("softmax", 2), ("log_softmax", 1), ("log_softmax", 1),
        ("log_softmax", 1), ("softmax", 1), ("log_softmax", 1)]
    assert nodes[6].attrs["dtype"] == "float64" and nodes[0].attrs["dtype"] is None
    rule = get_rule("softmax")
    assert get_rule("log_softmax") is rule
    assert [(d.name, d.role) for d in nodes[1].dims] == [
        ("sample", "sample"), ("d1", "attribute"), ("d2", "attribute"), ("softmax", "attribute")]
    assert [d.name for d in nodes[3].dims] == ["sample", "softmax", "d2", "d3"]
    assert rule.splittable(nodes[0]) == (True, False, True, True)
    assert rule.splittable(nodes[1]) == (True, True, True, False)
    assert rule.splittable(nodes[4]) == (True, False)
    box = ((0, 4), (0, 6), (2, 4), (0, 12))
    assert rule.input_regions(nodes[0], box) == (box,)
