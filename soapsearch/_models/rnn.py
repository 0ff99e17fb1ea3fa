"""Recurrent zoo models: RNNTC, RNNLM and NMT (plain PyTorch LSTMs).

Each recurrent layer is its own single-layer ``nn.LSTM(batch_first=True)``
module so a planner can place and split layers independently.  Every model is
``torch.fx.symbolic_trace``-able and its ``forward(inputs, targets)`` returns
the mean cross-entropy training loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RNNTCConfig", "RNNTC", "RNNLMConfig", "RNNLM", "NMTConfig", "NMT", "LSTMStack"]


class LSTMStack(nn.Module):
    """A stack of single-layer batch-first LSTMs, one module per layer."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        sizes = [input_size] + [hidden_size] * (num_layers - 1)
        self.layers = nn.ModuleList(
            nn.LSTM(s, hidden_size, num_layers=1, batch_first=True) for s in sizes
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lstm in self.layers:
            x, _ = lstm(x)
        return x


@dataclass(frozen=True)
class RNNTCConfig:
    """RNN text classifier: embedding -> LSTM stack -> last step -> linear."""

    vocab_size: int = 20480
    """Input vocabulary size."""
    embed_size: int = 2048
    """Token embedding width."""
    hidden_size: int = 2048
    """LSTM hidden width."""
    num_layers: int = 4
    """Number of stacked LSTM layers."""
    num_classes: int = 2
    """Number of output classes (movie-review sentiment: 2)."""
    seq_len: int = 20
    """Tokens per example input sequence."""


class RNNTC(nn.Module):
    """LSTM text classifier returning the training loss."""

    def __init__(self, cfg: RNNTCConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_size)
        self.lstm = LSTMStack(cfg.embed_size, cfg.hidden_size, cfg.num_layers)
        self.fc = nn.Linear(cfg.hidden_size, cfg.num_classes)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.lstm(self.embed(inputs))
        logits = self.fc(out[:, -1])
        return F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class RNNLMConfig:
    """LSTM language model: embedding -> LSTM stack -> linear to vocab."""

    vocab_size: int = 10000
    """Vocabulary size (Penn Treebank: 10k words)."""
    embed_size: int = 2048
    """Token embedding width."""
    hidden_size: int = 2048
    """LSTM hidden width."""
    num_layers: int = 2
    """Number of stacked LSTM layers."""
    seq_len: int = 20
    """Tokens per example input sequence (unrolled steps)."""


class RNNLM(nn.Module):
    """LSTM language model returning the next-token training loss."""

    def __init__(self, cfg: RNNLMConfig) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_size)
        self.lstm = LSTMStack(cfg.embed_size, cfg.hidden_size, cfg.num_layers)
        self.fc = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.fc(self.lstm(self.embed(inputs)))
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


@dataclass(frozen=True)
class NMTConfig:
    """LSTM encoder-decoder with Luong-style (dot) attention."""

    src_vocab_size: int = 20480
    """Source vocabulary size."""
    tgt_vocab_size: int = 20480
    """Target vocabulary size."""
    embed_size: int = 2048
    """Source and target embedding width."""
    hidden_size: int = 2048
    """LSTM hidden width (encoder and decoder; also attention width)."""
    num_layers: int = 2
    """LSTM layers in the encoder and, separately, in the decoder."""
    src_len: int = 20
    """Source tokens per example."""
    tgt_len: int = 20
    """Target tokens per example."""


class NMT(nn.Module):
    """Attentional seq2seq; ``inputs`` is ``[B, src_len + tgt_len]`` token ids."""

    def __init__(self, cfg: NMTConfig) -> None:
        super().__init__()
        self.src_len = cfg.src_len
        self.tgt_len = cfg.tgt_len
        self.tgt_vocab_size = cfg.tgt_vocab_size
        self.src_embed = nn.Embedding(cfg.src_vocab_size, cfg.embed_size)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, cfg.embed_size)
        self.encoder = LSTMStack(cfg.embed_size, cfg.hidden_size, cfg.num_layers)
        self.decoder = LSTMStack(cfg.embed_size, cfg.hidden_size, cfg.num_layers)
        self.attn_combine = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.tgt_vocab_size)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        src = inputs[:, : self.src_len]
        tgt = inputs[:, self.src_len :]
        enc = self.encoder(self.src_embed(src))
        dec = self.decoder(self.tgt_embed(tgt))
        scores = torch.bmm(dec, enc.transpose(1, 2))
        attn = F.softmax(scores, dim=-1)
        ctx = torch.bmm(attn, enc)
        h = torch.tanh(self.attn_combine(torch.cat([dec, ctx], dim=-1)))
        logits = self.out(h)
        return F.cross_entropy(
            logits.reshape(-1, self.tgt_vocab_size), targets.reshape(-1)
        )
