"""Ground truth of the rules of today's LLM ops: rms_norm, index, expand, repeat_interleave,
triangle, factory and attention with grouped-query heads and a mask. Every partition computed
from only the regions its rule names equals its slice of the real output, on random degree
grids (``rulecheck.check_model``, float64); the modules are written as LLaMA and HF transformers
write them, and none of them leaves an opaque op."""

import collections
import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch._models.llama import apply_rope, rope_tables
from soapsearch.trace import trace
from strategies.rules import get_rule
from strategies.rules.gather import repeat_rows
from strategies.rules.mask import local_diagonal
from tests.strategies.rulecheck import adapt, check_model


def _kinds(model, inputs) -> collections.Counter:
    return collections.Counter(n.kind for n in trace(model, tuple(inputs)))


def _ops(model, inputs, kind):
    return [n for n in trace(model, tuple(inputs)) if n.kind == kind]


# --- rms_norm ---------------------------------------------------------------------------------

class Norms(nn.Module):
    """nn.RMSNorm with eps None (torch's finfo eps) and a float eps, over one and two trailing
    dims, without a weight; F.rms_norm with a weight tensor and without one."""

    def __init__(self):
        super().__init__()
        self.a = nn.RMSNorm(12)
        self.b = nn.RMSNorm([3, 12], eps=1e-3)
        self.c = nn.RMSNorm(12, elementwise_affine=False)
        self.g = nn.Parameter(torch.rand(12) + 0.5)
        with torch.no_grad():
            self.a.weight.uniform_(0.5, 1.5)
            self.b.weight.uniform_(0.5, 1.5)

    def forward(self, x):  # (N, 6, 12)
        h = self.a(x) + F.rms_norm(x, (12,), self.g, 1e-6)
        h = self.c(F.rms_norm(h, h.shape[-1:]))
        return self.b(h.view(-1, 2, 3, 12))


def test_rms_norm_regions_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(8, 6, 12) * 3
    assert _kinds(Norms(), [x])["rms_norm"] == 5
    assert check_model(Norms(), [x], {"rms_norm"}, count=12) >= 5 * 6


def test_rms_norm_dims_weights_and_attrs():
    x = torch.randn(8, 6, 12)
    a, f1, f2, c, b = _ops(Norms(), [x], "rms_norm")
    assert [(d.name, d.role) for d in a.dims] == [
        ("sample", "sample"), ("seq", "attribute"), ("features", "parameter")]
    rule = get_rule("rms_norm")
    assert rule.splittable(a) == (True, True, False)
    assert rule.splittable(b) == (True, True, False, False)
    assert [(w.role, w.name) for w in a.weights] == [("weight", "a.weight")]
    assert c.weights == () and f2.weights == () and f2.attrs["param_inputs"] == ()
    assert f1.attrs["param_inputs"] == ("weight",) and len(f1.inputs) == 2
    assert dict(a.attrs) == {"normalized_shape": (12,), "eps": None}
    assert b.attrs["normalized_shape"] == (3, 12) and b.attrs["eps"] == 1e-3
    assert f1.attrs["eps"] == 1e-6
    box = ((0, 4), (2, 4), (0, 12))
    assert rule.input_regions(f1, box) == (box, ((0, 12),))
    assert rule.weight_regions(a, box) == {"weight": ((0, 12),)}


class HandRMSNorm(nn.Module):
    """LLaMA's reference RMSNorm, x · rsqrt(mean(x²) + eps) · w, written out."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_hand_written_rms_norm_is_pointwise_and_reduce():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    kinds = _kinds(HandRMSNorm(8), [x])
    assert set(kinds) == {"input", "parameter", "elementwise", "reduce", "mul"}, kinds
    assert kinds["reduce"] == 1 and kinds["mul"] == 2
    assert check_model(HandRMSNorm(8), [x], count=8) >= 6 * 4


# --- SiLU / SwiGLU ----------------------------------------------------------------------------

class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(8, 12, bias=False), nn.Linear(8, 12, bias=False)
        self.w2 = nn.Linear(12, 8, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x)) + self.act(x)


def test_swiglu_is_linear_silu_mul():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    kinds = _kinds(SwiGLU(), [x])
    assert kinds == {"input": 1, "linear": 3, "elementwise": 2, "mul": 1, "add": 1}
    assert check_model(SwiGLU(), [x], count=6) >= 8 * 6


# --- rotary embeddings ------------------------------------------------------------------------

class CachedRope(nn.Module):
    """RoPE on [B, H, T, hd] with cos/sin caches sliced by [:T] (the zoo's llama) and indexed
    by a position tensor (``cos[position_ids]``)."""

    def __init__(self):
        super().__init__()
        cos, sin = rope_tables(16, 4, 10000.0)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, q, position_ids):  # q [B, H, T, 4]; position_ids [B, T]
        T = q.size(2)
        a = apply_rope(q, self.cos[:T], self.sin[:T])
        cos, sin = self.cos[position_ids][:, None], self.sin[position_ids][:, None]  # [B, 1, T, 4]
        return a + apply_rope(q, cos, sin)


class HFRotary(nn.Module):
    """HF transformers' LlamaRotaryEmbedding.forward and apply_rotary_pos_emb: cos/sin from
    inv_freq[None, :, None].float().expand(B, -1, 1) @ position_ids[:, None, :].float()."""

    def __init__(self, dim: int = 4, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.attention_scaling = 1.0

    def forward(self, q, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype=q.dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype=q.dtype)
        return q * cos.unsqueeze(1) + _hf_rotate_half(q) * sin.unsqueeze(1)


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _positions(batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(16, generator=g)[:seq] for _ in range(batch)])


def test_rope_cached_and_indexed_tables():
    torch.manual_seed(0)
    q, pos = torch.randn(4, 2, 6, 4), _positions(4, 6)
    kinds = _kinds(CachedRope(), [q, pos])
    assert "opaque" not in kinds and kinds["index"] == 2 and kinds["concat"] == 2, kinds
    assert check_model(CachedRope(), [q, pos], count=6) >= 20 * 6


def test_rope_hf_llama_rotary_embedding():
    torch.manual_seed(0)
    q, pos = torch.randn(4, 2, 6, 4), _positions(4, 6)
    kinds = _kinds(HFRotary(), [q, pos])
    assert "opaque" not in kinds and kinds["expand"] == 1 and kinds["matmul"] == 1, kinds
    assert check_model(HFRotary(), [q, pos], count=6) >= 15 * 6


# --- index ------------------------------------------------------------------------------------

class Lookup(nn.Module):
    """A [10, 3, 4] table indexed by [B, T] ids, and index_select of its rows."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(10, 3, 4))

    def forward(self, x, ids):  # x [B, T, 3, 4]
        return x * self.table[ids] + torch.index_select(self.table, 0, ids[0])


def test_index_regions_reproduce_output():
    torch.manual_seed(0)
    x, ids = torch.randn(4, 6, 3, 4), torch.randint(0, 10, (4, 6))
    node = _ops(Lookup(), [x, ids], "index")[0]
    assert node.shape == (4, 6, 3, 4) and [d.name for d in node.dims] == ["sample", "d1", "d2", "d3"]
    rule = get_rule("index")
    assert rule.splittable(node) == (True,) * 4
    box = ((2, 4), (0, 3), (1, 2), (0, 4))
    assert rule.input_regions(node, box) == (((0, 10), (1, 2), (0, 4)), ((2, 4), (0, 3)))
    assert check_model(Lookup(), [x, ids], {"index"}, count=12) >= 12 + 10  # [4,6,3,4] and [6,3,4]


def test_index_by_a_mask_is_not_an_index_op():
    class Masked(nn.Module):
        def forward(self, x, ids):
            return x[x > 0].sum() + x[ids].sum()

    fxops = adapt(Masked(), [torch.randn(4, 3), torch.tensor([2, 0])], operator.getitem)
    assert fxops[0] is None and fxops[1].kind == "index"  # a mask selects data-dependent rows


# --- grouped-query attention ------------------------------------------------------------------

class GQA(nn.Module):
    """Hq = 4 query heads over Hkv = 2 key/value heads three ways: repeat_interleave, the
    x[:, :, None].expand(...).reshape(...) of HF's repeat_kv, and SDPA's enable_gqa."""

    def forward(self, q, k, v):  # q [B, 4, T, d]; k, v [B, 2, T, d]
        B, T, d = q.size(0), q.size(2), q.size(3)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(2, dim=1),
                                           torch.repeat_interleave(v, 2, dim=1), is_causal=True)
        kx = k[:, :, None, :, :].expand(B, 2, 2, T, d).reshape(B, 4, T, d)
        vx = v[:, :, None].expand(B, 2, 2, T, d).reshape(B, 4, T, d)
        b = F.scaled_dot_product_attention(q, kx, vx)
        c = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return a + b + F.scaled_dot_product_attention(q, k, v, enable_gqa=True) + c


def _gqa_inputs(batch=2, seq=6, d=4):
    return torch.randn(batch, 4, seq, d), torch.randn(batch, 2, seq, d), torch.randn(batch, 2, seq, d)


def test_gqa_three_ways_reproduce_output():
    torch.manual_seed(0)
    ins = _gqa_inputs()
    kinds = _kinds(GQA(), ins)
    assert "opaque" not in kinds and kinds["repeat_interleave"] == 2 and kinds["expand"] == 2, kinds
    n = check_model(GQA(), ins, {"repeat_interleave", "expand", "reshape", "attention"}, count=10)
    assert n >= 10 * 8


def test_gqa_attention_regions_and_degrees():
    ins = _gqa_inputs()
    node = _ops(GQA(), ins, "attention")[2]  # c: causal, enable_gqa
    assert dict(node.attrs) == {"is_causal": True, "scale": None, "enable_gqa": True, "has_mask": False}
    rule = get_rule("attention")
    assert rule.check_degrees(node, (1, 2, 1, 1)) is None
    why = rule.check_degrees(node, (1, 4, 1, 1))
    assert why == ("op 'scaled_dot_product_attention_2': degree 4 on dim 'heads'(4) does not divide "
                   "the 2 key/value heads of grouped-query attention (4 // 2 = 2 query heads per "
                   "group): a partition must hold whole groups")
    # q-heads [2, 4) of g = 2 read kv-head [1, 2); causal rows [3, 6) read keys [0, 6)
    q_r, k_r, v_r = rule.input_regions(node, ((0, 1), (2, 4), (3, 6), (0, 4)))
    assert q_r == ((0, 1), (2, 4), (3, 6), (0, 4))
    assert k_r == v_r == ((0, 1), (1, 2), (0, 6), (0, 4))


def test_repeat_interleave_rows():
    assert repeat_rows(0, 4, 2) == (0, 2) and repeat_rows(3, 5, 2) == (1, 3)
    assert repeat_rows(5, 6, 3) == (1, 2)  # output row 5 of repeats 3 is input row 1
    ins = _gqa_inputs(seq=4)
    node = _ops(GQA(), ins, "repeat_interleave")[0]
    assert dict(node.attrs) == {"repeats": 2, "dim": 1}
    assert get_rule("repeat_interleave").input_regions(node, ((0, 2), (1, 3), (0, 4), (0, 4))) == (
        ((0, 2), (0, 2), (0, 4), (0, 4)),)


def test_repeat_interleave_odd_rows_reproduce_output():
    """Repeats 3 cut into pieces that start mid-group (degree 2 on 6 rows: rows [3, 6))."""

    class Rep(nn.Module):
        def forward(self, x):
            return x.repeat_interleave(3, dim=1) * 2

    torch.manual_seed(0)
    assert check_model(Rep(), [torch.randn(4, 2, 5)], {"repeat_interleave"}, count=12) >= 8


# --- masks: triangle, factory, masked_fill, where ---------------------------------------------

def test_local_diagonal_offset():
    """triu(x, d)[i, j] keeps j - i >= d; a piece at rows r0.., cols c0.. keeps j' - i' >=
    d + r0 - c0. Checked here on every 2x3 piece grid of a 6x6 for several d, against torch."""
    assert local_diagonal(1, (4, 8), (0, 4)) == 5 and local_diagonal(0, (0, 2), (3, 6)) == -3
    x = torch.randn(6, 6)
    for d in (-2, 0, 1, 3):
        for upper, fn in ((True, torch.triu), (False, torch.tril)):
            full = fn(x, d)
            for r0 in (0, 3):
                for c0 in (0, 2, 4):
                    rows, cols = (r0, r0 + 3), (c0, c0 + 2)
                    piece = fn(x[r0:r0 + 3, c0:c0 + 2], local_diagonal(d, rows, cols))
                    assert torch.equal(piece, full[r0:r0 + 3, c0:c0 + 2]), (d, upper, r0, c0)


class Masks(nn.Module):
    """Causal masks as GPT-2/LLaMA code builds them, from the input's length: a bool tril of
    ones, an additive triu of -inf over a full, masked_fill and where on scores."""

    def forward(self, x):  # [B, H, T, T] scores
        T = x.size(-1)
        keep = torch.ones((T, T), dtype=torch.bool, device=x.device).tril()
        add = torch.triu(torch.full((T, T), float("-inf")), diagonal=1) + x.new_zeros(T, T)
        bias = torch.tril(torch.ones_like(x), diagonal=-1) + torch.arange(T).float()
        a = x.masked_fill(~keep, -1e4).softmax(-1)
        return torch.where(keep, a, x) + (x + add).softmax(-1) + bias


def test_masks_reproduce_output():
    torch.manual_seed(0)
    x = torch.randn(2, 2, 6, 6)
    kinds = _kinds(Masks(), [x])
    assert "opaque" not in kinds and kinds["triangle"] == 3 and kinds["factory"] == 5, kinds
    assert check_model(Masks(), [x], {"triangle", "factory", "elementwise"}, count=10) >= 10 * 9
    tri = _ops(Masks(), [x], "triangle")
    assert [dict(t.attrs) for t in tri] == [{"upper": False, "diagonal": 0},
                                           {"upper": True, "diagonal": 1},
                                           {"upper": False, "diagonal": -1}]
    fac = _ops(Masks(), [x], "factory")
    assert [f.attrs["fn"] for f in fac] == ["torch.ones", "torch.full", "torch.full", "torch.full",
                                            "torch.arange"]
    assert fac[3].dims[0].role == "sample"  # ones_like(x) doubles with the batch


class MaskedSDPA(nn.Module):
    """SDPA with an explicit mask: boolean [T, T], additive float [B, 1, T, T]."""

    def forward(self, q, k, v):  # q [B, H, T, d]; k, v [B, H, S, d]
        T, S = q.size(2), k.size(2)
        keep = torch.ones((T, S), dtype=torch.bool).tril(diagonal=S - T)
        add = torch.zeros_like(q[:, :1, :, :1]) * k[:, :1, :, 0][:, :, None, :]
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
                + F.scaled_dot_product_attention(q, k, v, attn_mask=add + 0.5, scale=0.3))


def test_attention_with_mask_reproduces_output():
    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 8, 4)
    v = torch.randn(2, 2, 8, 4)
    att = _ops(MaskedSDPA(), [q, k, v], "attention")
    assert [a.attrs["has_mask"] for a in att] == [True, True] and len(att[0].inputs) == 4
    rule = get_rule("attention")
    box = ((1, 2), (0, 1), (2, 4), (0, 4))
    assert rule.input_regions(att[0], box)[3] == ((2, 4), (0, 8))
    assert rule.input_regions(att[1], box)[3] == ((1, 2), (0, 1), (2, 4), (0, 8))
    assert check_model(MaskedSDPA(), [q, k, v], {"attention"}, count=12) >= 2 * 8


def test_masked_causal_and_dropout_attention_stay_opaque():
    class Bad(nn.Module):
        def forward(self, q):
            mask = torch.ones(6, 6, dtype=torch.bool)
            return (F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
                    + F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=False))

    kinds = _kinds(Bad(), [torch.randn(2, 2, 6, 4)])
    assert kinds["attention"] == 1 and kinds["opaque"] == 1


def test_zoo_llama_ops_reproduce_output():
    """The zoo's tiny llama: its RMSNorms, grouped-query attention and RoPE concats."""
    from soapsearch import zoo
    model, (x, y) = zoo.build("llama", "tiny")
    n = check_model(model, [x, y], {"rms_norm", "attention", "concat"}, count=4, max_parts=4)
    assert n >= (5 + 2 + 4) * 3


def test_factory_partitions_slice_the_whole_tensor():
    """eye, linspace and arange with a step: each partition builds the tensor and keeps its box."""

    class Consts(nn.Module):
        def forward(self, x):  # x [B, T]
            T = x.size(1)
            return (x @ torch.eye(T, dtype=x.dtype) + torch.linspace(0, 1, T, dtype=x.dtype)
                    + torch.arange(1, 2 * T, 2).to(x.dtype))

    torch.manual_seed(0)
    x = torch.randn(4, 6)
    fac = _ops(Consts(), [x], "factory")
    assert [f.attrs["fn"] for f in fac] == ["torch.eye", "torch.linspace", "torch.arange"]
    assert fac[2].attrs["args"] == (1, 12, 2) and fac[2].output.dtype == "int64"
    rule = get_rule("factory")
    assert rule.input_regions(fac[0], ((2, 4), (0, 6))) == ()
    torch.testing.assert_close(rule.forward(fac[2], ((3, 6),), [], {}), torch.tensor([7, 9, 11]))
    assert check_model(Consts(), [x], {"factory"}, count=6) >= 3 + 1 + 1
