"""Multi-output ops (split, chunk, unbind: each item read is a slice op) and
nn.MultiheadAttention traced op by op (soapsearch/_fx/multi.py, soapsearch/_fx/mha.py)."""

import contextvars
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from soapsearch._fx.base import MULTI
from soapsearch._fx.multi import item_op, multi_output
from soapsearch.trace import _FLOP_FORMULAS, _symbolic_trace, trace
from strategies.region import full_box, slice_box
from strategies.rules import OPAQUE, get_rule
from strategies.rules.pointwise import dropout_generator, set_dropout_seed
from tests.executor import models_multi as M
from tests.strategies.rulecheck import check_op, grids


def run_graph(graph, model, inputs) -> dict:
    """Every op computed whole by its rule from the regions it names: what the OpGraph computes."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    env = {}
    for node in graph:
        if node.kind == "input":
            env[node.name] = inputs[node.attrs["index"]]
            continue
        rule, box = get_rule(node.kind), full_box(node.shape)
        ins = [None if r is None else env[i][slice_box(r)]
               for i, r in zip(node.inputs, rule.input_regions(node, box))]
        ws = {role: state[node.weight(role).name][slice_box(r)]
              for role, r in rule.weight_regions(node, box).items()}
        env[node.name] = rule.forward(node, box, ins, ws)
    return env


def outputs(graph, model, inputs) -> list:
    env = run_graph(graph, model, inputs)
    return [env[o] for o in graph.outputs]


def unread(graph) -> list[str]:
    """Ops that no op reads and the model does not return."""
    read = {i for n in graph for i in n.inputs} | set(graph.outputs)
    return [n.name for n in graph if n.name not in read]


# --- the fused-qkv nanoGPT block --------------------------------------------------------
@pytest.mark.parametrize("how", ["split", "chunk"])
def test_fused_qkv_block_has_no_opaque_op(how):
    torch.manual_seed(0)
    model, ins = getattr(M, f"nanogpt_{how}")(4)
    graph = trace(model, ins)
    sep = trace(*M.nanogpt_separate(4))
    assert not [n.name for n in graph if n.kind == OPAQUE] and not unread(graph)
    tokens, C, T, d = 4 * M.SEQ, M.EMBD, M.SEQ, M.EMBD // M.HEADS
    block = 2 * tokens * C * (3 * C + C + 4 * C + 4 * C) + 4 * 4 * M.HEADS * T * T * d  # + SDPA
    assert sum(n.flops for n in graph) == sum(n.flops for n in sep) == 2 * block + 2 * tokens * C * M.VOCAB
    slices = [n for n in graph if n.kind == "slice"]
    assert [n.inputs for n in slices] == [("blocks_0_attn_c_attn",)] * 3 + [("blocks_1_attn_c_attn",)] * 3
    assert [[list(e) for e in n.attrs["index"]] for n in slices[:3]] == [
        [[0, 4, 1], [0, 8, 1], [a, a + 16, 1]] for a in (0, 16, 32)]
    assert [d.role for d in slices[0].dims] == ["sample", "attribute", "attribute"]
    assert len(graph) == len(sep) + 2  # 3 slices instead of 2 extra Linears, per block
    attn = M.FusedAttention(how=how).double()
    x = torch.randn(4, 8, M.EMBD, dtype=torch.float64)
    got, = outputs(trace(attn, (x,)), attn, [x])
    torch.testing.assert_close(got, attn(x), rtol=1e-12, atol=1e-12)


class Edges(nn.Module):
    """A negative dim, an uneven last chunk and a split size larger than the dim."""

    def forward(self, x):  # x: [N, 7, 5]
        a, b, c = x.chunk(3, dim=-2)  # chunks of ceil(7/3) = 3: 3, 3, 1
        (whole,) = x.split(9, dim=1)
        d, e = torch.split(x, 3, dim=-1)  # 3 and 2
        return a + 1, b * c, whole - 1, e.sum(-1), d.unbind(-1)[2]


def test_negative_dim_uneven_and_oversized_splits():
    torch.manual_seed(0)
    x = torch.randn(4, 7, 5, dtype=torch.float64)
    graph = trace(Edges(), (x,))
    idx = {n.name: [e if isinstance(e, int) else list(e) for e in n.attrs["index"]]
           for n in graph if n.kind == "slice"}
    assert list(idx.values()) == [
        [[0, 4, 1], [0, 3, 1], [0, 5, 1]], [[0, 4, 1], [3, 6, 1], [0, 5, 1]],
        [[0, 4, 1], [6, 7, 1], [0, 5, 1]], [[0, 4, 1], [0, 7, 1], [0, 5, 1]],
        [[0, 4, 1], [0, 7, 1], [0, 3, 1]], [[0, 4, 1], [0, 7, 1], [3, 5, 1]],
        [[0, 4, 1], [0, 7, 1], 2]]  # unbind(-1) of d: item 2 of its [4, 7, 3]
    assert graph[list(idx)[-1]].inputs == (list(idx)[4],)
    for got, want in zip(outputs(graph, Edges(), [x]), Edges()(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _node_of(value: torch.Tensor) -> fx.Node:
    g = fx.Graph()
    n = g.placeholder("x")
    n.meta["val"] = value
    return n


def test_multi_output_helper_for_other_adapters():
    x = _node_of(torch.empty(4, 6))
    m = multi_output(x, -1, [0, 2, 6], drop_dim=False)
    assert (m.kind, m.inputs, m.attrs) == (MULTI, [x], {"dim": 1, "bounds": [0, 2, 6], "drop": False})
    assert item_op(m, -1).attrs == {"index": [[0, 4, 1], [2, 6, 1]]}
    assert item_op(multi_output(x, 0, [0, 1, 2, 3, 4], True), 3).attrs == {"index": [3, [0, 6, 1]]}
    assert item_op(m, 2) is None and item_op(m, slice(0, 1)) is None
    with pytest.raises(ValueError, match=r"^multi-output op of 'x': boundaries \[0, 2, 7\] on dim 1 "
                                         r"must rise from 0 to its size 6$"):
        multi_output(x, 1, [0, 2, 7], False)
    with pytest.raises(ValueError, match=r"drop_dim needs items of one row, boundaries \[0, 2, 4\]"):
        multi_output(x, 0, [0, 2, 4], True)
    with pytest.raises(ValueError, match=r"dim 2 is outside its 2 dims"):
        multi_output(x, 2, [0, 6], False)


# --- nn.MultiheadAttention ----------------------------------------------------------------
E, H, L, S, N = 12, 3, 5, 7, 4


class SelfAttend(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, mask: torch.Tensor | None = None,
                 returns_weights: bool = False, **kw):
        super().__init__()
        self.attn, self.kw, self.returns_weights = mha, kw, returns_weights
        self.register_buffer("mask", mask)

    def forward(self, x):
        kw = dict(self.kw, attn_mask=self.mask) if self.mask is not None else self.kw
        out, w = self.attn(x, x, x, **kw)
        return (out, w) if self.returns_weights else out


class CrossAttend(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, **kw):
        super().__init__()
        self.attn, self.kw = mha, kw

    def forward(self, q, k, v):
        return self.attn(q, k, v, **self.kw)[0]


def _seq(batch_first: bool, length: int, dim: int = E) -> torch.Tensor:
    return torch.randn((N, length, dim) if batch_first else (length, N, dim), dtype=torch.float64)


CAUSAL = torch.ones(L, L, dtype=torch.bool).triu(1)
CASES = {
    "batch_first-need_weights_false": lambda: (SelfAttend(nn.MultiheadAttention(E, H, batch_first=True),
                                                          need_weights=False), [_seq(True, L)]),
    "seq_first-no_bias-weights_discarded": lambda: (SelfAttend(nn.MultiheadAttention(E, H, bias=False)),
                                                    [_seq(False, L)]),
    "causal_hint": lambda: (SelfAttend(nn.MultiheadAttention(E, H, batch_first=True), CAUSAL,
                                       is_causal=True, need_weights=False), [_seq(True, L)]),
    "causal_hint-weights_discarded": lambda: (SelfAttend(nn.MultiheadAttention(E, H), CAUSAL,
                                                         is_causal=True), [_seq(False, L)]),
    "float_mask": lambda: (SelfAttend(nn.MultiheadAttention(E, H, batch_first=True),
                                      torch.randn(L, L, dtype=torch.float64)), [_seq(True, L)]),
    "per_head_bool_mask": lambda: (SelfAttend(nn.MultiheadAttention(E, H), (torch.rand(N * H, L, L) < 0.3) & ~torch.eye(L, dtype=torch.bool),
                                              need_weights=False), [_seq(False, L)]),
    "cross": lambda: (CrossAttend(nn.MultiheadAttention(E, H, batch_first=True)),
                      [_seq(True, L), _seq(True, S), _seq(True, S)]),
    "cross-kdim_vdim": lambda: (CrossAttend(nn.MultiheadAttention(E, H, kdim=6, vdim=10), need_weights=False),
                                [_seq(False, L), _seq(False, S, 6), _seq(False, S, 10)]),
    "weights_used": lambda: (SelfAttend(nn.MultiheadAttention(E, H, batch_first=True), returns_weights=True),
                             [_seq(True, L)]),
    "weights_per_head": lambda: (SelfAttend(nn.MultiheadAttention(E, H), returns_weights=True,
                                            average_attn_weights=False), [_seq(False, L)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mha_traced_computes_the_module(case):
    torch.manual_seed(0)
    model, ins = CASES[case]()
    model = model.double()
    for name, p in model.named_parameters():  # torch starts the biases at 0
        if "bias" in name:
            nn.init.normal_(p)
    graph = trace(model, tuple(ins))
    assert not [n.name for n in graph if n.kind == OPAQUE] and not unread(graph)
    names = {w.name for n in graph for w in n.weights}
    buffers = {k for k, _ in model.named_buffers()}  # a mask
    assert names - buffers == {k for k, _ in model.named_parameters()}  # each under its own name
    want = model(*ins)
    want = list(want) if isinstance(want, tuple) else [want]
    got = outputs(graph, model, ins)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS) as counter:
        model(*ins)
    flops = sum(n.flops for n in graph)
    assert abs(flops - counter.get_total_flops()) <= 0.03 * counter.get_total_flops(), (flops, counter.get_total_flops())


def test_mha_kernel_choice_follows_what_the_caller_reads():
    def kinds(case):
        model, ins = CASES[case]()
        return sorted(n.kind for n in trace(model.double(), tuple(ins)))

    fused = kinds("batch_first-need_weights_false")
    assert fused.count("attention") == 1 and "softmax" not in fused and "reduce" not in fused
    assert kinds("seq_first-no_bias-weights_discarded").count("attention") == 1  # weights unread
    explicit = kinds("weights_used")
    assert "attention" not in explicit and explicit.count("softmax") == 1 and explicit.count("reduce") == 1
    assert explicit.count("matmul") == 3 + 2  # projections, then q·kᵀ and softmax·v
    assert kinds("float_mask").count("softmax") == 1 and "constant" in kinds("float_mask")
    causal = kinds("causal_hint")  # the mask buffer the fused kernel does not read is no op
    assert causal.count("attention") == 1 and "constant" not in causal


def test_mha_dropout_drops_the_softmax_as_torch_does(monkeypatch):
    torch.manual_seed(0)
    model = SelfAttend(nn.MultiheadAttention(E, H, dropout=0.25)).double().train()
    x = _seq(False, L)
    graph = trace(model, (x,))
    drop, = [n for n in graph if n.kind == "dropout"]
    assert drop.attrs == {"p": 0.25, "training": True}
    assert graph[drop.inputs[0]].kind == "softmax" and drop.shape == (N, H, L, L)

    def run():
        set_dropout_seed(7)
        keep = torch.rand(drop.shape, generator=dropout_generator(drop.name)) >= 0.25

        def rule_mask(t, p=0.5, training=True, inplace=False):  # torch's dropout, the rule's mask
            assert t.shape == (N * H, L, L) and p == 0.25
            return t * keep.view(N * H, L, L) / (1 - p)

        monkeypatch.setattr(torch.nn.functional, "dropout", rule_mask)
        return outputs(graph, model, [x])[0], model(x)

    got, want = contextvars.copy_context().run(run)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_mha_key_padding_mask_stays_one_module_op():
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, x, pad):
            return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]

    graph = trace(Padded(), (torch.randn(N, L, E), torch.zeros(N, L, dtype=torch.bool)))
    assert [(n.name, n.kind) for n in graph if n.kind == OPAQUE] == [("attn", OPAQUE)]


def test_mha_ops_reproduce_output_on_random_grids():
    """rulecheck's ground truth for every op of a traced attention (cross, with mask)."""
    torch.manual_seed(0)
    model = CrossAttend(nn.MultiheadAttention(E, H, batch_first=True)).double()
    ins = [_seq(True, L), _seq(True, S), _seq(True, S)]
    graph = trace(model, tuple(ins))
    gm = _symbolic_trace(copy.deepcopy(model))
    values = {}

    class Keep(fx.Interpreter):
        def run_node(self, n):
            values[n.name] = super().run_node(n)
            return values[n.name]

    Keep(gm).run(*ins)
    checked = 0
    for node in graph:
        if node.kind == "input":
            continue
        for g in grids(node, max_parts=6, count=3):
            check_op(graph, values, model, node.name, g)
            checked += 1
    assert checked >= 60
