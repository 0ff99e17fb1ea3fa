"""Models for the LLM parity tests: a tied weight (one Parameter read by two ops, whose gradient
is the sum of both uses) and the LLM ops the zoo's llama does not use. Factories for
``build_model("tests.executor.models_llm:<name>")``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from soapsearch import zoo
from soapsearch._models.llama import apply_rope, rope_tables

SPEC = f"{__name__}:"
"""The prefix of this file's model specs (``SPEC + "tied_gpt"``)."""


def tied_gpt(batch_size: int = 4):
    """The zoo's tiny GPT with GPT-2's tie: ``lm_head.weight is wte.weight`` (an embedding and
    a linear read one [vocab, n_embd] weight)."""
    model, inputs = zoo.build("gpt", "tiny", batch_size=batch_size)
    model.lm_head.weight = model.wte.weight
    return model, inputs


def fused_gpt(batch_size: int = 4):
    """The zoo's tiny GPT with Megatron-LM's fused query-key-value linear (``fused_qkv``: one
    ``Linear(16, 48)`` viewed per head as [q k v])."""
    return zoo.build("gpt", "tiny", batch_size=batch_size, fused_qkv=True)


class TiedMatmul(nn.Module):
    """An embedding whose weight is read again by the model itself (``get_attr``, a parameter
    op) as the output projection: logits = tanh(E[x]) · Eᵀ."""

    def __init__(self, vocab: int = 12, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.vocab = vocab

    def forward(self, x, t):
        logits = torch.tanh(self.emb(x)) @ self.emb.weight.t()
        return F.cross_entropy(logits.view(-1, self.vocab), t.view(-1))


def tied_matmul(batch_size: int = 4):
    return TiedMatmul(), (torch.randint(0, 12, (batch_size, 6)), torch.randint(0, 12, (batch_size, 6)))


class LLMOps(nn.Module):
    """One attention block written with the LLM ops the zoo's llama does not use: positions
    from ``torch.arange`` (a factory), RoPE tables indexed by them (index), grouped-query heads
    by ``repeat_interleave`` (k) and by ``[:, :, None].expand(...).reshape(...)`` (v), a causal
    boolean mask from ``torch.ones(...).tril()`` (factory, triangle) passed to SDPA, and a
    hand-written RMSNorm."""

    def __init__(self, vocab: int = 12, dim: int = 8, seq: int = 6):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.q, self.o = nn.Linear(dim, 8, bias=False), nn.Linear(8, dim, bias=False)
        self.k, self.v = nn.Linear(dim, 4, bias=False), nn.Linear(dim, 4, bias=False)
        self.norm = nn.Parameter(torch.rand(dim) + 0.5)
        self.head = nn.Linear(dim, vocab)
        cos, sin = rope_tables(seq, 2, 10000.0)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x, t):
        B, T = x.size(0), x.size(1)
        h = self.emb(x)
        pos = torch.arange(T, device=x.device)
        cos, sin = self.cos[pos], self.sin[pos]
        q = apply_rope(self.q(h).view(B, T, 4, 2).transpose(1, 2), cos, sin)
        k = apply_rope(self.k(h).view(B, T, 2, 2).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
        v = self.v(h).view(B, T, 2, 2).transpose(1, 2)[:, :, None].expand(B, 2, 2, T, 2).reshape(B, 4, T, 2)
        mask = torch.ones((T, T), dtype=torch.bool, device=x.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.o(y.transpose(1, 2).reshape(B, T, 8))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return F.cross_entropy(self.head(h).view(-1, self.vocab), t.view(-1))


def llm_ops(batch_size: int = 4):
    return LLMOps(), (torch.randint(0, 12, (batch_size, 6)), torch.randint(0, 12, (batch_size, 6)))
