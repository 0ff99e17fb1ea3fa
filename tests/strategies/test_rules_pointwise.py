import contextvars

import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.region import full_box, partition_boxes, slice_box
from strategies.rules import get_rule
from strategies.rules.pointwise import FUNCTIONS, dropout_generator, set_dropout_seed
from tests.strategies.rulecheck import check_model, grids, reference_values, run_partitions

POINTWISE = {"elementwise", "add", "mul"}


def _kinds(model, inputs):
    return {n.name: n.kind for n in trace(model, tuple(inputs))}


class ActivationMLP(nn.Module):
    """Linear layers with module, function and method activations between them."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 4), nn.Linear(4, 4), nn.Linear(4, 8)
        self.acts = nn.Sequential(nn.ReLU(), nn.GELU(approximate="tanh"), nn.Tanh(), nn.SiLU(),
                                  nn.Sigmoid(), nn.LeakyReLU(0.2), nn.ELU(0.7), nn.Softplus(2.0),
                                  nn.Hardtanh(-0.3, 0.4), nn.ReLU6(inplace=True), nn.Mish())

    def forward(self, x):
        h = self.acts(self.fc1(x))
        h = F.gelu(self.fc2(h)) + torch.relu(h) + F.relu(h, inplace=False) + h.tanh()
        h = torch.tanh(h).exp() + (h.abs() + 1).log() * h.neg().sigmoid()
        h = h.clamp(min=-0.5, max=0.5) + torch.clamp(h, 0.1).pow(2) + torch.sigmoid(h).sqrt()
        return self.fc3(h.detach() * h)


def test_activations_reproduce_output():
    torch.manual_seed(0)
    model, x = ActivationMLP(), torch.randn(4, 6, 12)
    kinds = _kinds(model, [x])
    assert sum(k == "elementwise" for k in kinds.values()) >= 25
    assert kinds["mul"] == "mul"  # h.detach() * h: two distinct tensors
    assert check_model(model, [x], POINTWISE, count=6) >= 30 * 7


class Scalars(nn.Module):
    def forward(self, x):
        y = x * 0.5 + 1
        y = 2 - y / (x.size(-1) ** 0.5) + 3 * y - y // 0.3 + y % 0.7
        y = 1 / (y.abs() + 1) + y ** 2 + 2 ** y + torch.add(y, 1.5, alpha=2) * y.mul(-1)
        y = torch.where(y > 0.5, y, 0.0) + torch.where(y < 0, -y, y) + (y >= 0).float()
        return torch.pow(y, 3) - torch.true_divide(y, 4) * torch.nan_to_num(torch.log(y))


def test_scalar_operands_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 4)
    node = next(n for n in trace(Scalars(), (x,)) if n.attrs.get("fn") == "operator.sub")
    assert dict(node.attrs)["args"][0] == 2 and node.kind == "elementwise"
    assert check_model(Scalars(), [x], POINTWISE, count=6) >= 30 * 7


class Broadcasts(nn.Module):
    """Tensor-tensor add/mul/sub/div with numpy broadcasting, from parameters and inputs."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(6))
        self.scale = nn.Parameter(torch.randn(6, 1))
        self.row = nn.Parameter(torch.randn(1, 8))

    def forward(self, x, y):
        h = x + self.bias[None, :, None]  # [4, 6, 8] + [1, 6, 1]
        h = h * self.scale + self.row  # [6, 1]: missing leading dim and a size-1 dim
        h = torch.add(h, y, alpha=0.5) - torch.mul(h, y) / (y.abs() + 1)  # y: [4, 1, 8]
        h = h.add(x).mul(x) + torch.maximum(h, y) + torch.where(x > 0, h, y)
        h += y  # fx records it as operator.add
        return h * h


def test_broadcasting_add_mul_reproduce_output():
    torch.manual_seed(0)
    model, ins = Broadcasts(), [torch.randn(4, 6, 8), torch.randn(4, 1, 8)]
    graph = trace(model, tuple(ins))
    kinds = [n.kind for n in graph]
    assert kinds.count("add") >= 6 and kinds.count("mul") >= 3
    add = graph["add"]
    assert add.inputs == ("x", "getitem") and get_rule("add").splittable(add) == (True,) * 3
    assert [(d.name, d.role) for d in add.dims] == [("sample", "sample"), ("d1", "attribute"),
                                                    ("d2", "attribute")]
    assert get_rule("add").input_regions(add, ((2, 4), (3, 6), (4, 8))) == (
        ((2, 4), (3, 6), (4, 8)), ((0, 1), (3, 6), (0, 1)))
    assert check_model(model, ins, POINTWISE, count=12) >= 15 * 12


class CausalMask(nn.Module):
    def __init__(self, t=8):
        super().__init__()
        # a parameter, not a buffer: fx proxies parameters only (a buffer sliced by a traced size fails)
        self.mask = nn.Parameter(torch.tril(torch.ones(t, t)).view(1, 1, t, t), requires_grad=False)

    def forward(self, att):
        T = att.size(-1)
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        return att.masked_fill(att > 1.0, 1.0) + torch.masked_fill(att, att < -1.0, -1.0)


def test_causal_masked_fill_reproduces_output():
    torch.manual_seed(0)
    att = torch.randn(2, 4, 6, 6)
    node = trace(CausalMask(), (att,))["masked_fill"]
    assert node.attrs["args"][2] == float("-inf") and node.input_specs[1].dtype == "bool"
    assert check_model(CausalMask(), [att], POINTWISE, count=16) >= 5 * 16


class Casts(nn.Module):
    def __init__(self):
        super().__init__()
        self.same = nn.Identity()

    def forward(self, x):
        a = x.float() + 1  # a cast in a float64 run
        b = x.double().contiguous().clone().to(torch.float64).type(torch.float64)  # aliases
        return a, self.same(b) * 2, x.to(torch.float32).half()


def test_casts_and_aliases():
    torch.manual_seed(0)
    x = torch.randn(4, 6).double()
    graph = trace(Casts(), (x,))
    assert [(n.name, n.kind) for n in graph] == [
        ("x", "input"), ("float_1", "elementwise"), ("add", "elementwise"),
        ("mul", "elementwise"), ("to_1", "elementwise"), ("half", "elementwise")]
    assert graph["mul"].inputs == ("x",)  # double/contiguous/clone/to/type/Identity are x itself
    assert dict(graph["half"].attrs) == {"fn": "cast", "args": ({"input": 0}, {"dtype": "float16"}),
                                         "kwargs": {}}
    assert check_model(Casts(), [x], POINTWISE, count=12) >= 5 * 7


class Drop(nn.Module):
    def __init__(self, p, train):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.p, self.train_ = p, train

    def forward(self, x):
        return F.dropout(self.drop(x), self.p, training=self.train_) * 2


def test_dropout_identity_matches_module():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    assert check_model(Drop(0.0, True), [x], {"dropout"}, count=12) >= 2 * 12
    assert check_model(Drop(0.5, False).eval(), [x], {"dropout"}, count=12) >= 2 * 12


def test_dropout_partitions_slice_one_mask():
    """p > 0: the split run equals the rule's own full-box run (same seed), which drops about p."""
    torch.manual_seed(0)
    model, x = Drop(0.25, True).double(), torch.randn(8, 6, 12).double() + 3
    graph, values = reference_values(model, [x])
    n = 0
    for name in ("drop", "dropout"):
        node, rule = graph[name], get_rule("dropout")
        assert node.kind == "dropout" and dict(node.attrs) == {"p": 0.25, "training": True}
        src = values[node.inputs[0]]
        # a fresh context, as the partitions' threads have: the default seed
        full = contextvars.Context().run(rule.forward, node, full_box(node.shape), [src], {})
        kept = full != 0
        assert abs((src[~kept] != 0).double().sum().item() / (src != 0).sum().item() - 0.25) < 0.05
        torch.testing.assert_close(full[kept], (src / 0.75)[kept])
        values[name] = full
        for g in grids(node, count=16):
            outs = run_partitions(graph, values, model, name, g)
            for box, out in zip(partition_boxes(node.shape, g), outs):
                torch.testing.assert_close(out, full[slice_box(box)])
            n += 1
    assert n >= 2 * 16
    seeds = [dropout_generator("drop", s).initial_seed() for s in (0, 1)] + \
        [dropout_generator("drop_1", 0).initial_seed()]
    assert len(set(seeds)) == 3 and seeds[0] == dropout_generator("drop", 0).initial_seed()

    def with_seed(seed):
        set_dropout_seed(seed)
        return get_rule("dropout").forward(graph["drop"], full_box((8, 6, 12)), [x], {})
    a, b = (contextvars.copy_context().run(with_seed, s) for s in (7, 8))
    assert not torch.equal(a, b) and torch.equal(a, contextvars.copy_context().run(with_seed, 7))


class Reductions(nn.Module):
    def forward(self, x):
        m = x.mean(1) + x.sum(dim=-1).sum(-1)[:, None]  # [4, 8, 6] -> [4, 6]
        k = torch.mean(x, dim=1, keepdim=True) + torch.amax(x, dim=(1, 2), keepdim=True)
        s = torch.sum(x, dim=[0, 2]) + x.logsumexp(2).amin(0) + x.var(2, correction=0).std(0)
        return m, k, s, x.prod(1), torch.sum(x, 1, dtype=torch.float64)


def test_reductions_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 6)
    graph = trace(Reductions(), (x,))
    mean = graph["mean"]
    rule = get_rule("reduce")
    assert mean.kind == "reduce" and dict(mean.attrs) == {"fn": "mean", "dims": (1,), "keepdim": False,
                                                         "kwargs": {}}
    assert rule.splittable(mean) == (True, True) and mean.dims[0].role == "sample"
    assert rule.input_regions(mean, ((0, 2), (3, 6))) == (((0, 2), (0, 8), (3, 6)),)
    assert rule.input_regions(graph["mean_1"], ((0, 2), (0, 1), (3, 6))) == (((0, 2), (0, 8), (3, 6)),)
    assert sum(n.kind == "reduce" for n in graph) == 12
    assert check_model(Reductions(), [x], {"reduce"}, count=10) >= 60


def test_full_reduction_and_inplace_are_not_pointwise():
    graph = trace(nn.Sequential(), (torch.randn(4, 6),))
    assert [n.kind for n in graph] == ["input"]

    class Full(nn.Module):
        def forward(self, x):
            return x.sum() + x.mean(), torch.relu_(x * 1)
    kinds = _kinds(Full(), [torch.randn(4, 6)])
    assert kinds["sum_1"] == "opaque" and kinds["mean"] == "opaque" and kinds["relu_"] == "opaque"


def test_function_table_names():
    for name in ("F.gelu", "F.relu", "torch.tanh", "Tensor.masked_fill", "operator.truediv", "cast",
                 "Tensor.relu", "torch.where", "F.silu"):
        assert name in FUNCTIONS, name
