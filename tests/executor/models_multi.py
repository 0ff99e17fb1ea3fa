"""Tiny language models whose attention the tracer must take apart: a nanoGPT with one fused qkv
Linear cut into q, k and v (``split``, ``chunk``, or three Linears for comparison), and models
built on ``nn.MultiheadAttention`` (a causal self-attention, batch first, through SDPA; a
sequence-first one with dropout in training, computed explicitly). Factories for
``build_model("tests.executor.models_multi:<name>")``: (model, example inputs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

SPEC = f"{__name__}:"
"""The prefix of this file's model specs (``SPEC + "nanogpt_split"``)."""
VOCAB, SEQ, EMBD, HEADS = 32, 8, 16, 4


class FusedAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: ``c_attn`` makes q, k and v at once (``how`` cuts them:
    ``split`` or ``chunk``; ``separate`` has three Linears instead)."""

    def __init__(self, C: int = EMBD, H: int = HEADS, how: str = "split"):
        super().__init__()
        self.C, self.H, self.how = C, H, how
        if how == "separate":
            self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        else:
            self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.size()
        if self.how == "split":
            q, k, v = self.c_attn(x).split(self.C, dim=2)
        elif self.how == "chunk":
            q, k, v = self.c_attn(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(B, T, self.H, C // self.H).transpose(1, 2)
        k = k.view(B, T, self.H, C // self.H).transpose(1, 2)
        v = v.view(B, T, self.H, C // self.H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """Pre-LayerNorm block around any attention module (``attn(x)`` -> x's shape)."""

    def __init__(self, attn: nn.Module, C: int = EMBD):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), attn, nn.LayerNorm(C)
        self.fc, self.proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class LM(nn.Module):
    """Token and position embeddings, blocks, a LayerNorm and the head: mean next-token loss."""

    def __init__(self, blocks: list[nn.Module], C: int = EMBD):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, C)
        self.wpe = nn.Parameter(torch.randn(SEQ, C) * 0.1)
        self.blocks = nn.Sequential(*blocks)
        self.ln_f, self.lm_head = nn.LayerNorm(C), nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx, targets):
        logits = self.lm_head(self.ln_f(self.blocks(self.wte(idx) + self.wpe)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class SelfMHA(nn.Module):
    """``nn.MultiheadAttention`` self-attention; causal (a bool mask buffer with the is_causal
    hint, weights not asked for) or not (default need_weights, the weights discarded)."""

    def __init__(self, batch_first: bool, dropout: float, causal: bool, C: int = EMBD, H: int = HEADS):
        super().__init__()
        self.mha = nn.MultiheadAttention(C, H, dropout=dropout, batch_first=batch_first)
        self.batch_first, self.causal = batch_first, causal
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))

    def forward(self, x):
        if not self.batch_first:
            x = x.transpose(0, 1)
        if self.causal:
            y = self.mha(x, x, x, attn_mask=self.mask, is_causal=True, need_weights=False)[0]
        else:
            y, _ = self.mha(x, x, x)
        return y if self.batch_first else y.transpose(0, 1)


def _data(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ))


def _gpt(how: str, batch_size: int):
    return LM([Block(FusedAttention(how=how)) for _ in range(2)]), _data(batch_size)


def nanogpt_split(batch_size: int = 8):
    return _gpt("split", batch_size)


def nanogpt_chunk(batch_size: int = 8):
    return _gpt("chunk", batch_size)


def nanogpt_separate(batch_size: int = 8):
    return _gpt("separate", batch_size)


def mha_causal(batch_size: int = 8):
    """Batch first, causal, no dropout: attention is one SDPA op."""
    return LM([Block(SelfMHA(True, 0.0, True)) for _ in range(2)]), _data(batch_size)


def mha_dropout(batch_size: int = 8):
    """Sequence first, dropout 0.1 in training: attention computed explicitly, dropout on the
    softmax."""
    return LM([Block(SelfMHA(False, 0.1, False))]), _data(batch_size)
