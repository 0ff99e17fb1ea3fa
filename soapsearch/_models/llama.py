"""A LLaMA-style decoder-only transformer (Touvron et al. 2023, "LLaMA"; Dubey et al. 2024, "The
Llama 3 Herd of Models"): pre-RMSNorm blocks, rotary position embeddings, a SwiGLU MLP,
grouped-query attention and an untied output head.

``forward(inputs, targets)`` returns the mean next-token cross-entropy, as every zoo model does,
and the model traces with ``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "rope_tables", "apply_rope", "rotate_half"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a LLaMA-style model; the defaults are LLaMA-3 8B (Dubey et al. 2024, Table 3)."""

    n_layer: int = 32
    """Number of transformer blocks."""
    d_model: int = 4096
    """Model (residual stream) width."""
    ffn_hidden: int = 14336
    """Hidden width of the SwiGLU MLP (w1, w3: d_model -> ffn_hidden; w2 back)."""
    n_head: int = 32
    """Query heads per block; must divide ``d_model``."""
    n_kv_head: int = 8
    """Key/value heads per block (grouped-query attention, Ainslie et al. 2023); must divide
    ``n_head``."""
    vocab_size: int = 128256
    """Vocabulary size (LLaMA-3's tiktoken-based tokenizer)."""
    seq_len: int = 8192
    """Tokens per sequence (LLaMA-3 pre-training context) and rows of the RoPE tables."""
    rope_theta: float = 500000.0
    """RoPE base frequency θ (Su et al. 2021, eq. 15; LLaMA-3 raises it to 500000)."""
    norm_eps: float = 1e-5
    """ε of every RMSNorm."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"llama: d_model ({self.d_model}) must be divisible by n_head "
                             f"({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"llama: n_head ({self.n_head}) must be divisible by n_kv_head "
                             f"({self.n_kv_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"llama: head_dim = d_model / n_head = {self.d_model} / "
                             f"{self.n_head} = {self.d_model // self.n_head} must be even (RoPE "
                             "rotates pairs)")


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles m·θ_i, θ_i = theta^(-2i/head_dim) (Su et al. 2021, eq. 15),
    each [seq_len, head_dim] with the half-split layout of ``rotate_half`` (HF transformers)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim (the rotation of RoPE in half-split layout)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin: each pair of x rotated by its position's angle."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention: n_head query heads share n_kv_head key/value heads
    (SDPA with ``enable_gqa``), RoPE on q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, hd = x.size(0), x.size(1), self.head_dim
        q = self.wq(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * hd))


class SwiGLU(nn.Module):
    """w2(silu(w1·x) ⊙ w3·x) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)) (pre-RMSNorm)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """LLaMA-style language model returning the next-token training loss. Input sequences have
    exactly ``seq_len`` tokens (as the zoo's GPT): the RoPE tables are buffers of that many rows
    (in the state_dict, so every rank of a split run reads the same values), read whole."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_theta)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1))
