"""Dense zoo models: a multilayer perceptron and a GPT-2 style transformer.

Every model is ``torch.fx.symbolic_trace``-able and its ``forward(inputs,
targets)`` returns the mean cross-entropy training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPConfig", "MLP", "GPTConfig", "GPT"]


@dataclass(frozen=True)
class MLPConfig:
    """Linear/ReLU stack followed by a linear classifier."""

    in_features: int = 1024
    """Width of the (dense, float) input."""
    hidden: tuple[int, ...] = (8192,) * 7
    """Widths of the hidden Linear+ReLU layers, in order."""
    num_classes: int = 8192
    """Number of output classes (width of the last Linear)."""


class MLP(nn.Module):
    """Multilayer perceptron classifier returning the training loss."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = cfg.in_features
        for width in cfg.hidden:
            layers += [nn.Linear(prev, width), nn.ReLU(inplace=False)]
            prev = width
        layers.append(nn.Linear(prev, cfg.num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.layers(inputs), targets)


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 style decoder-only transformer (pre-LayerNorm, learned positions)."""

    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 768
    """Model (residual stream) width."""
    seq_len: int = 1024
    """Block size: input sequences must have exactly this many tokens."""
    vocab_size: int = 50257
    """Vocabulary size (GPT-2 BPE)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output and MLP output."""
    tie_embeddings: bool = False
    """``lm_head`` reads ``wte``'s weight (GPT-2 and GPT-3 tie them; the zoo's default keeps
    them apart)."""
    fused_qkv: bool = False
    """One query-key-value linear of width 3·n_embd, its output per head [q k v] as Megatron-LM
    lays it out (``megatron/model/transformer.py`` ParallelAttention.query_key_value;
    ``megatron/core/transformer/attention.py`` SelfAttention.linear_qkv), so a column split
    over whole heads gives each member of the tensor-parallel group its heads' q, k and v; the default keeps three linears."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(
                f"gpt: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections, or one fused
    ``qkv`` projection (``GPTConfig.fused_qkv``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.fused_qkv = cfg.fused_qkv
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        else:
            self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
            self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
            self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C, H = x.size(0), x.size(1), self.n_embd, self.n_head
        if self.fused_qkv:  # [B, T, 3C] viewed per head as [q k v] (Megatron-LM's split_tensor_along_last_dim)
            qkv = self.qkv(x).view(B, T, H, 3 * (C // H)).split(C // H, dim=-1)
            # items read by index: fx cannot unpack a traced split
            q, k, v = qkv[0].transpose(1, 2), qkv[1].transpose(1, 2), qkv[2].transpose(1, 2)
        else:
            q = self.q(x).view(B, T, H, C // H).transpose(1, 2)
            k = self.k(x).view(B, T, H, C // H).transpose(1, 2)
            v = self.v(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.dropout(self.proj(y))


class FeedForward(nn.Module):
    """Linear(C, 4C) -> GELU -> Linear(4C, C) -> dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style language model returning the next-token training loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Parameter(torch.empty(cfg.seq_len, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe, std=0.02)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(inputs) + self.wpe)
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, self.vocab_size), targets.view(-1))
