import copy
import itertools
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch.trace import trace
from strategies.rules import get_rule
from tests.strategies.rulecheck import check_model, check_op, reference_values, run_partitions


def _ops(model, inputs, kind):
    return [n for n in trace(model, inputs) if n.kind == kind]


def _layout(node):
    return [(d.name, d.size, d.role) for d in node.dims], get_rule(node.kind).splittable(node)


def test_linear_regions_reproduce_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 6, bias=False))
    assert check_model(model, [torch.randn(4, 5, 12)], {"linear"}, count=12) >= 12


# --- matmul ---------------------------------------------------------------------------------

class Luong(nn.Module):
    """Luong dot attention of an NMT decoder: scores and context are both bmm."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, dec, enc):  # [B, T, H], [B, S, H]
        scores = torch.bmm(dec, enc.transpose(1, 2))
        ctx = F.softmax(scores, dim=-1).bmm(enc)
        return torch.matmul(ctx, self.w) + (dec @ enc.transpose(1, 2)).matmul(enc)


class Scores4d(nn.Module):
    """q @ kᵀ on [B, h, T, d], against a per-head table [h, d, T] and a [1, h, d, S] one."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2, 4, 6))
        self.shared = nn.Parameter(torch.randn(1, 2, 4, 8))

    def forward(self, q, k, r):  # q, k [B, h, T, d]; r [B, 1, T, d]
        return (q @ k.transpose(-2, -1), torch.matmul(q, self.table), r.matmul(self.shared))


def test_matmul_bmm_luong_attention():
    torch.manual_seed(0)
    n = check_model(Luong(), [torch.randn(4, 6, 4), torch.randn(4, 8, 4)], {"matmul"}, count=12)
    assert n >= 5 * 12


def test_matmul_4d_broadcasting():
    torch.manual_seed(0)
    q, k, r = torch.randn(4, 2, 6, 4), torch.randn(4, 2, 6, 4), torch.randn(4, 1, 6, 4)
    assert check_model(Scores4d(), [q, k, r], {"matmul"}, count=14) >= 3 * 14
    ops = _ops(Scores4d(), (q, k, r), "matmul")
    assert _layout(ops[0]) == ([("sample", 4, "sample"), ("batch1", 2, "attribute"),
                                ("rows", 6, "attribute"), ("cols", 6, "attribute"),
                                ("inner", 4, "reduction")], (True,) * 5)
    rule, box = get_rule("matmul"), ((2, 4), (1, 2), (0, 3), (4, 6), (0, 4))
    assert rule.input_regions(ops[1], box) == (((2, 4), (1, 2), (0, 3), (0, 4)), ((1, 2), (0, 4), (4, 6)))
    assert rule.input_regions(ops[2], box) == (((2, 4), (0, 1), (0, 3), (0, 4)),
                                               ((0, 1), (1, 2), (0, 4), (4, 6)))
    inner = box[:-1] + ((1, 3),)  # a cut of the inner dim: its columns of A, its rows of B
    assert rule.input_regions(ops[1], inner) == (((2, 4), (1, 2), (0, 3), (1, 3)), ((1, 2), (1, 3), (4, 6)))


def test_matmul_2d_and_vector_opaque():
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 8))
            self.v = nn.Parameter(torch.randn(8))

        def forward(self, x):
            return torch.matmul(x, self.w) @ self.v

    x = torch.randn(12, 6)
    assert check_model(M(), [x], {"matmul"}, count=10) >= 10
    kinds = [n.kind for n in trace(M(), (x,))]
    assert kinds.count("matmul") == 1 and "opaque" in kinds
    assert _layout(_ops(M(), (x,), "matmul")[0])[0] == [("sample", 12, "sample"), ("cols", 8, "attribute"),
                                                         ("inner", 6, "reduction")]


# --- embedding ------------------------------------------------------------------------------

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(20, 12, padding_idx=0)
        self.pos = nn.Embedding(16, 12)
        self.weight = nn.Parameter(torch.randn(10, 8))

    def forward(self, ids, pos):  # [B, T], [B, T]
        return self.tok(ids) + self.pos(pos), F.embedding(ids % 10, self.weight, padding_idx=-1)


def test_embedding_ids_and_functional():
    torch.manual_seed(0)
    ids, pos = torch.randint(0, 20, (4, 6)), torch.arange(6).repeat(4, 1)
    assert check_model(Embed(), [ids, pos], {"embedding"}, count=12) >= 3 * 12
    ops = _ops(Embed(), (ids, pos), "embedding")
    assert _layout(ops[0]) == ([("sample", 4, "sample"), ("seq", 6, "attribute"),
                                ("embed_dim", 12, "parameter"), ("vocab", 20, "reduction")], (True,) * 4)
    assert ops[0].attrs["padding_idx"] == 0 and ops[2].attrs["padding_idx"] == 9
    assert [w.name for w in ops[2].weights] == ["weight"]
    box = ((0, 2), (0, 6), (4, 8), (0, 20))
    assert get_rule("embedding").input_regions(ops[0], box) == (((0, 2), (0, 6)),)
    assert get_rule("embedding").weight_regions(ops[0], box) == {"weight": ((0, 20), (4, 8))}
    rows = ((0, 2), (0, 6), (4, 8), (10, 15))  # a vocab-parallel partition: rows 10-14 only
    assert get_rule("embedding").weight_regions(ops[0], rows) == {"weight": ((10, 15), (4, 8))}


def test_embedding_variants():
    torch.manual_seed(0)
    freq = nn.Sequential(nn.Embedding(20, 8, scale_grad_by_freq=True))
    ids = torch.randint(0, 20, (4, 6))
    assert check_model(freq, [ids], {"embedding"}) == 3  # embed_dim cut in 2, 4, 8 only
    assert get_rule("embedding").splittable(_ops(freq, (ids,), "embedding")[0]) == (False, False, True, False)
    flat = nn.Sequential(nn.Embedding(20, 8, sparse=True))
    assert check_model(flat, [torch.randint(0, 20, (8,))], {"embedding"}, count=8) >= 8
    assert [n.kind for n in trace(nn.Embedding(20, 8, max_norm=1.0), (ids,))][-1] == "opaque"


# --- attention ------------------------------------------------------------------------------

class SDPA(nn.Module):
    def __init__(self, causal, scale=None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)


class CausalSelfAttention(nn.Module):
    """GPT attention block (as in the zoo): q/k/v projections, heads split, causal sdpa, merge."""

    def __init__(self, c=12, h=4):
        super().__init__()
        self.h, self.proj = h, nn.Linear(c, c)
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x):
        B, T, C = x.size()
        q = self.q(x).view(B, T, self.h, C // self.h).transpose(1, 2)
        k = self.k(x).view(B, T, self.h, C // self.h).transpose(1, 2)
        v = self.v(x).view(B, T, self.h, C // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_self(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 6) for _ in range(3))
    assert check_model(SDPA(causal), [q, k, v], {"attention"}, count=20) == 14  # every grid
    node = _ops(SDPA(causal), (q, k, v), "attention")[0]
    assert _layout(node) == ([("sample", 2, "sample"), ("heads", 4, "attribute"),
                              ("seq", 8, "attribute"), ("head_dim", 6, "attribute")],
                             (True, True, True, False))
    q_r, k_r, v_r = get_rule("attention").input_regions(node, ((0, 1), (2, 4), (2, 4), (0, 6)))
    assert q_r == ((0, 1), (2, 4), (2, 4), (0, 6))
    assert k_r == v_r == ((0, 1), (2, 4), (0, 4) if causal else (0, 8), (0, 6))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_cross_lengths_and_scale(causal):
    torch.manual_seed(0)
    for s in (12, 4):  # more and fewer keys than queries (causal aligns top-left)
        q, k, v = torch.randn(2, 2, 8, 4), torch.randn(2, 2, s, 4), torch.randn(2, 2, s, 6)
        assert check_model(SDPA(causal, scale=0.3), [q, k, v], {"attention"}, count=12) == 11
    q3, k3 = torch.randn(4, 8, 4), torch.randn(4, 8, 4)  # no heads dim
    assert check_model(SDPA(causal), [q3, k3, k3], {"attention"}, count=12) == 8
    node = _ops(SDPA(causal), (q3, k3, k3), "attention")[0]
    assert [d.name for d in node.dims] == ["sample", "seq", "head_dim"]


def test_attention_gpt_block_and_opaque_cases():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 12)
    assert check_model(CausalSelfAttention(), [x], {"attention", "linear"}, count=12) >= 24
    q = torch.randn(2, 4, 8, 6)

    class Masked(nn.Module):
        def forward(self, q, k, v):
            mask = torch.ones(8, 8, dtype=torch.bool).tril()
            return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                    F.scaled_dot_product_attention(q, k, v, dropout_p=0.1))

    # the mask is an input of the attention op (has_mask); dropout stays opaque
    assert [n.kind for n in trace(Masked(), (q, q, q))].count("attention") == 1


# --- reduction dims: Partial sums ------------------------------------------------------------

def _reduction_grids(node, count, seed, max_parts=8):
    """Random valid grids of ``node`` that cut a reduction dim (alone or with other dims)."""
    rng = random.Random(seed)
    ok = get_rule(node.kind).splittable(node)
    choices = [[d for d in range(1, max_parts + 1) if s % d == 0] if ok[i] else [1]
               for i, s in enumerate(node.shape)]
    cut = [g for g in itertools.product(*choices)
           if math.prod(g) <= max_parts and any(g[i] > 1 for i in node.reduction_dims)]
    rng.shuffle(cut)
    return cut[:count]


@pytest.mark.parametrize("kind,model,inputs", [
    ("linear", lambda: nn.Sequential(nn.Linear(12, 8), nn.Linear(8, 6, bias=False)),
     lambda: [torch.randn(4, 5, 12)]),
    ("matmul", Luong, lambda: [torch.randn(4, 6, 4), torch.randn(4, 8, 4)]),
    ("embedding", Embed, lambda: [torch.randint(0, 20, (4, 6)), torch.arange(6).repeat(4, 1)]),
])
def test_partial_sums_equal_the_unsplit_op(kind, model, inputs):
    """The partitions sharing an output region on a cut reduction dim hold Partial sums whose
    sum is that region of the real output (random grids mixing reduction and other cuts)."""
    torch.manual_seed(0)
    m = copy.deepcopy(model()).double()
    xs = [x.double() if x.is_floating_point() else x for x in inputs()]
    graph, values = reference_values(m, xs)
    checked = 0
    for node in [n for n in graph if n.kind == kind]:
        assert [node.dims[i].role for i in node.reduction_dims] == ["reduction"]
        assert node.reduction_dims == (len(node.output.shape),)  # after the output's dims
        for g in _reduction_grids(node, 8, seed=checked):
            check_op(graph, values, m, node.name, g)
            parts = run_partitions(graph, values, m, node.name, g)
            if len(parts) == g[node.reduction_dims[0]]:  # only the reduction dim cut: each is partial
                assert all(not torch.allclose(p, values[node.name]) for p in parts)
            checked += 1
    assert checked >= 8


def test_row_parallel_linear_bias_once():
    """in_features cut 3 ways: only the partition whose range starts at 0 reads the bias, and
    each partition reads its columns of x and W (Megatron-LM's row-parallel linear)."""
    node = _ops(nn.Sequential(nn.Linear(6, 4)), (torch.randn(2, 6),), "linear")[0]
    assert [(d.name, d.role) for d in node.dims] == [("sample", "sample"), ("out_features", "parameter"),
                                                      ("in_features", "reduction")]
    rule = get_rule("linear")
    first, second = ((0, 2), (0, 4), (0, 2)), ((0, 2), (0, 4), (2, 4))
    assert rule.weight_regions(node, first) == {"weight": ((0, 4), (0, 2)), "bias": ((0, 4),)}
    assert rule.weight_regions(node, second) == {"weight": ((0, 4), (2, 4))}
    assert rule.input_regions(node, second) == (((0, 2), (2, 4)),)
    assert node.output_region(second) == ((0, 2), (0, 4))
