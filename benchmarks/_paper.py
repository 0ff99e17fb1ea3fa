"""A zoo model at paper scale for a cluster: built on the meta device with the zoo's batch per
device (FlexFlow's 64; 1 sequence for GPT-3's shapes and LLaMA) times the device count, and
traced."""

from __future__ import annotations

from typing import Any

from soapsearch import trace, zoo
from strategies import OpGraph

GPT2_VOCAB = 50257
"""GPT-2's BPE vocabulary (Radford et al. 2019), which GPT-3 kept (Brown et al. 2020)."""


def megatron_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary rows Megatron-LM builds for ``vocab`` tokens at tensor-parallel size ``tp``:
    padded up to a multiple of ``divisible_by`` x ``tp`` (``--make-vocab-size-divisible-by``, 128
    by default; ``_vocab_size_with_padding`` in Megatron-LM's tokenizer), so that its embedding
    and head cut on the vocabulary: GPT-2's 50,257 at T = 8 is 51,200, the vocabulary Narayanan
    et al. 2021 give for their GPT runs."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def paper_graph(name: str, num_devices: int, variant: str = "default", **overrides: Any) -> OpGraph:
    """``overrides``: config fields replaced (``zoo.build``'s), e.g. a padded ``vocab_size``."""
    model, inputs = zoo.build(name, variant, device="meta", **overrides)
    batch = inputs[0].shape[0] * num_devices
    model, inputs = zoo.build(name, variant, device="meta", batch_size=batch, **overrides)
    return trace(model, inputs, name=name if variant == "default" else variant)
