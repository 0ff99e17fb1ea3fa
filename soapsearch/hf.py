"""Hugging Face transformers models built from small configs, as MODEL factories
(``soapsearch show soapsearch.hf:llama``): one per model family, each returning the model wrapped
so that ``forward(input_ids, labels)`` returns its training loss, and a batch of token ids.

transformers is not a dependency of soapsearch: these factories import it when called
(``pip install transformers``; the ``test`` extra has it). The configs keep each family's own
architecture (its attention, norm, activation and position scheme) at a width and depth that
trace and train in seconds; dropout is 0, as in LLM pretraining, so one step on several devices
equals one device exactly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Family", "FAMILIES", "build", "LMLoss"]

SEQ_LEN = 16
VOCAB = 96


@dataclass(frozen=True)
class Family:
    """One model family: its transformers config and model classes, the task its loss trains
    (``causal``: next token; ``masked``: masked tokens; ``seq2seq``: the target sequence given the
    source) and the config fields that make it small (and its dropout 0)."""

    config: str
    model: str
    task: str
    fields: dict[str, Any] = field(default_factory=dict)


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)

FAMILIES: dict[str, Family] = {
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", "causal",
                   dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", "causal", dict(_DECODER, num_key_value_heads=2)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", "causal",
                      dict(_DECODER, num_key_value_heads=2, sliding_window=None)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", "causal", dict(_DECODER, num_key_value_heads=2)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", "causal",
                    dict(_DECODER, num_key_value_heads=1, head_dim=8)),
    "phi": Family("PhiConfig", "PhiForCausalLM", "causal", dict(_DECODER, resid_pdrop=0.0, embd_pdrop=0.0)),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal",
                       dict(_DECODER, hidden_dropout=0.0, attention_dropout=0.0)),
    "opt": Family("OPTConfig", "OPTForCausalLM", "causal",
                  dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                       dropout=0.0, attention_dropout=0.0)),
    "bert": Family("BertConfig", "BertForMaskedLM", "masked",
                   dict(_DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "t5": Family("T5Config", "T5ForConditionalGeneration", "seq2seq",
                 dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
    "bart": Family("BartConfig", "BartForConditionalGeneration", "seq2seq",
                   dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0)),
}


class LMLoss(nn.Module):
    """A transformers model whose ``forward(input_ids, labels)`` returns its loss (the mean
    cross-entropy over the labels that are not -100, as transformers computes it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(name: str, batch_size: int = 4, seq_len: int = SEQ_LEN) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Family ``name`` (a key of FAMILIES) with fresh weights and a batch of random token ids
    and labels (a masked LM's labels are -100 except at a quarter of the positions)."""
    if name not in FAMILIES:
        raise ValueError(f"soapsearch.hf: no family {name!r}; known: {', '.join(FAMILIES)}")
    fam = FAMILIES[name]
    transformers = importlib.import_module("transformers")
    transformers.logging.set_verbosity_error()  # notes on configs of this size, not errors
    config = getattr(transformers, fam.config)(**fam.fields)
    model = getattr(transformers, fam.model)(config)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    labels = torch.randint(0, VOCAB, (batch_size, seq_len))
    if fam.task == "masked":
        labels[:, torch.arange(seq_len) % 4 != 0] = -100
    return LMLoss(model), (ids, labels)


def _factory(name: str):
    def make(batch_size: int = 4):
        return build(name, batch_size)
    make.__name__ = name
    make.__doc__ = f"The {name} family (``FAMILIES[{name!r}]``): model and (input_ids, labels)."
    return make


globals().update({name: _factory(name) for name in FAMILIES})
