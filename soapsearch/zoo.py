"""Model zoo: the FlexFlow benchmark DNNs (plus an MLP, a GPT and a LLaMA) as plain PyTorch.

Every model's ``forward(inputs, targets)`` returns the scalar mean cross-entropy loss and is
traceable by ``torch.fx.symbolic_trace``.  Three variants exist per model:

* ``"default"`` -- the scale used in the FlexFlow paper (Jia, Zaharia, Aiken, "Beyond Data and
  Model Parallelism for Deep Neural Networks", SysML 2019, Section 8 / Table 3).  The paper names
  the networks, datasets and layer counts; the sizes it does not spell out are taken from the
  FlexFlow reference code (github.com/flexflow/FlexFlow: ``nmt/nmt.cc``, ``README`` and
  ``examples/cpp/MLP_Unify/mlp.cc``) or the canonical architecture, as noted next to each entry.
* ``"small"`` -- a model of 0.36-2.4M parameters (batch 16) big enough that compute, not
  per-call framework overhead, dominates a training step on one CPU core
  (``benchmarks/simulator_accuracy.py --variant small``), small enough for a laptop.
* ``"tiny"`` -- a KB-sized model with small inputs for fast tests.

``gpt`` also has ``"gpt3-1.3b"``, ``"gpt3-6.7b"``, ``"gpt3-13b"`` and ``"gpt3-175b"``: GPT-3 XL,
6.7B, 13B and 175B's shapes (Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1), to be built on the
meta device.

Example::

    model, (inputs, targets) = build("resnet101", "tiny", seed=0)
    model(inputs, targets).backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from soapsearch._models import (
    GPT,
    MLP,
    NMT,
    RNNLM,
    RNNTC,
    AlexNet,
    AlexNetConfig,
    GPTConfig,
    InceptionConfig,
    Llama,
    LlamaConfig,
    InceptionV3,
    MLPConfig,
    NMTConfig,
    ResNet,
    ResNetConfig,
    RNNLMConfig,
    RNNTCConfig,
)

__all__ = ["VARIANTS", "VARIANTS_HELP", "names", "describe", "config", "build"]

VARIANTS: tuple[str, ...] = ("default", "small", "tiny", "gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")
"""Known variants, in order: every model has the first three, gpt also the last four."""
VARIANTS_HELP = ("default (the paper's scale), small (a laptop's) or tiny (fast tests); gpt also gpt3-1.3b, "
                 "gpt3-6.7b, gpt3-13b, gpt3-175b (GPT-3's shapes)")
"""The variants in the words of every --variant help."""

# FlexFlow's reference code trains with 64 samples per GPU (nmt/nmt.cc: bs_per_worker = 64;
# README: "-b ... (default: 64)").  The zoo's default batch is that per-GPU figure; pass
# ``batch_size=64 * n_gpus`` to build() for a weak-scaling global batch.
_PAPER_BATCH = 64
_SMALL_BATCH = 16
_TINY_BATCH = 4

Inputs = tuple[torch.Tensor, torch.Tensor]


def _images(cfg: Any, batch: int) -> Inputs:
    x = torch.randn(batch, 3, cfg.image_size, cfg.image_size)
    return x, torch.randint(0, cfg.num_classes, (batch,))


def _rnntc_inputs(cfg: RNNTCConfig, batch: int) -> Inputs:
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    return x, torch.randint(0, cfg.num_classes, (batch,))


def _lm_inputs(cfg: RNNLMConfig | GPTConfig, batch: int) -> Inputs:
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    return x, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))


def _nmt_inputs(cfg: NMTConfig, batch: int) -> Inputs:
    src = torch.randint(0, cfg.src_vocab_size, (batch, cfg.src_len))
    tgt = torch.randint(0, cfg.tgt_vocab_size, (batch, cfg.tgt_len))
    return torch.cat([src, tgt], dim=1), torch.randint(0, cfg.tgt_vocab_size, (batch, cfg.tgt_len))


def _llama_inputs(cfg: LlamaConfig, batch: int) -> Inputs:
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    return x, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))


def _mlp_inputs(cfg: MLPConfig, batch: int) -> Inputs:
    x = torch.randn(batch, cfg.in_features)
    return x, torch.randint(0, cfg.num_classes, (batch,))


@dataclass(frozen=True)
class _Entry:
    description: str
    model: Callable[[Any], nn.Module]
    configs: dict[str, Any]
    batch: dict[str, int]
    inputs: Callable[[Any, int], Inputs]


_PAPER = {"default": _PAPER_BATCH, "small": _SMALL_BATCH, "tiny": _TINY_BATCH}

_REGISTRY: dict[str, _Entry] = {
    # Paper Table 3: AlexNet on ImageNet (3x224x224, 1000 classes); layout = torchvision's
    # single-tower "one weird trick" AlexNet (Krizhevsky 2014), 61.1M parameters.
    "alexnet": _Entry(
        "AlexNet (single-tower, torchvision layout): 5 conv + 3 FC on 3x224x224 ImageNet",
        AlexNet,
        {
            "default": AlexNetConfig(),
            "small": AlexNetConfig(num_classes=64, image_size=64, width=0.25, hidden=512),
            "tiny": AlexNetConfig(num_classes=10, image_size=64, width=0.125, hidden=64),
        },
        _PAPER,
        _images,
    ),
    # Paper Table 3: Inception-v3 on ImageNet; 299x299 input and block layout from Szegedy et
    # al. 2016 / torchvision (aux classifier dropped: the paper trains the main tower only).
    "inception_v3": _Entry(
        "Inception-v3 (torchvision layout, no aux logits) on 3x299x299 ImageNet, 1000 classes",
        InceptionV3,
        {
            "default": InceptionConfig(),
            "small": InceptionConfig(num_classes=64, image_size=75, width=0.125),
            "tiny": InceptionConfig(num_classes=10, image_size=75, width=0.125),
        },
        _PAPER,
        _images,
    ),
    # Paper Table 3: ResNet-101 on ImageNet; Bottleneck [3, 4, 23, 3] from He et al. 2016.
    "resnet101": _Entry(
        "ResNet-101: bottleneck blocks [3, 4, 23, 3] with BatchNorm on 3x224x224 ImageNet",
        ResNet,
        {
            "default": ResNetConfig(),
            "small": ResNetConfig(layers=(1, 1, 1, 1), width=16, num_classes=64, image_size=32),
            "tiny": ResNetConfig(layers=(1, 1, 1, 1), width=8, num_classes=10, image_size=32),
        },
        _PAPER,
        _images,
    ),
    # Paper Table 3: RNNTC = 4 recurrent layers + softmax, Movie Reviews (2 classes).  Sizes
    # (embed = hidden = 2048, vocab 20K = 20*1024, 20 unrolled steps) follow FlexFlow's
    # nmt/nmt.cc, the reference RNN driver of the paper's code.
    "rnntc": _Entry(
        "RNNTC: embedding + 4 stacked LSTMs + linear text classifier (movie reviews, 2 classes)",
        RNNTC,
        {
            "default": RNNTCConfig(),
            "small": RNNTCConfig(vocab_size=1024, embed_size=128, hidden_size=128, num_layers=2,
                                 num_classes=4, seq_len=16),
            "tiny": RNNTCConfig(vocab_size=50, embed_size=16, hidden_size=16, num_layers=2,
                                num_classes=4, seq_len=8),
        },
        _PAPER,
        _rnntc_inputs,
    ),
    # Paper Table 3: RNNLM = 2 recurrent layers + softmax, Penn Treebank (10K-word vocabulary,
    # Mikolov's PTB split).  Embed/hidden 2048 and 20 steps from FlexFlow nmt/nmt.cc.
    "rnnlm": _Entry(
        "RNNLM: embedding + 2 stacked LSTMs + linear to a 10K Penn Treebank vocabulary",
        RNNLM,
        {
            "default": RNNLMConfig(),
            "small": RNNLMConfig(vocab_size=1024, embed_size=128, hidden_size=128, num_layers=2,
                                 seq_len=16),
            "tiny": RNNLMConfig(vocab_size=50, embed_size=16, hidden_size=16, num_layers=2,
                                seq_len=8),
        },
        _PAPER,
        _lm_inputs,
    ),
    # Paper Table 3: NMT = 4 recurrent layers (2 encoder + 2 decoder) + attention + softmax, WMT
    # English-German.  num_layers = 2, embed = hidden = 2048, vocab 20*1024 and 20 steps per side
    # are FlexFlow nmt/nmt.cc's defaults.
    "nmt": _Entry(
        "NMT: 2+2 LSTM encoder-decoder with dot attention (WMT En-De), inputs = [src | tgt] ids",
        NMT,
        {
            "default": NMTConfig(),
            "small": NMTConfig(src_vocab_size=1024, tgt_vocab_size=1024, embed_size=128, hidden_size=128,
                               num_layers=2, src_len=12, tgt_len=12),
            "tiny": NMTConfig(src_vocab_size=50, tgt_vocab_size=40, embed_size=16, hidden_size=16,
                              num_layers=2, src_len=6, tgt_len=7),
        },
        _PAPER,
        _nmt_inputs,
    ),
    # Not in the paper.  Default = FlexFlow examples/cpp/MLP_Unify/mlp.cc: 1024-wide input,
    # seven 8192-wide ReLU layers and an 8192-way output (one of its two towers).
    "mlp": _Entry(
        "MLP: 1024 -> 7 x 8192 Linear/ReLU -> 8192-way classifier (FlexFlow MLP_Unify tower)",
        MLP,
        {
            "default": MLPConfig(),
            "small": MLPConfig(in_features=256, hidden=(1024, 1024, 1024), num_classes=64),
            "tiny": MLPConfig(in_features=16, hidden=(32, 32), num_classes=10),
        },
        _PAPER,
        _mlp_inputs,
    ),
    # Not in the paper.  Default = GPT-2 small (Radford et al. 2019: 12 layers, 12 heads, 768
    # wide, 1024 context, 50257 BPE vocab, dropout 0.1); batch 12 as in nanoGPT's
    # config/train_gpt2.py (per GPU).  ~124M parameters (lm_head untied: +38.6M).
    # gpt3-1.3b / gpt3-6.7b / gpt3-13b = Brown et al. 2020, Table 2.1: GPT-3 XL (24 layers,
    # d_model 2048, 16 heads of 128), GPT-3 6.7B (32 layers, d_model 4096, 32 heads of 128) and
    # GPT-3 13B (40 layers, 40 heads of 128: d_model 5120, which the table prints as 5140) and
    # GPT-3 175B (96 layers, d_model 12288, 96 heads of 128), context 2048, GPT-2's vocabulary,
    # embeddings tied (1.316B, 6.658B, 12.85B and 174.6B parameters).  Batch 1 sequence per
    # GPU: Megatron-LM's --micro-batch-size 1 of its GPT-3 scripts
    # (examples/gpt3/train_gpt3_175b_distributed.sh), the 0.5M-2M-token batches of Table 2.1
    # being reached by accumulating such micro-batches.
    "gpt": _Entry(
        "GPT-2 small style decoder-only transformer (12 x 768, 12 heads, 1024 ctx, 50257 vocab)",
        GPT,
        {
            "default": GPTConfig(),
            "small": GPTConfig(n_layer=2, n_head=4, n_embd=128, seq_len=32, vocab_size=1024),
            "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=8, vocab_size=50),
            "gpt3-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, seq_len=2048, tie_embeddings=True),
            "gpt3-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, seq_len=2048, tie_embeddings=True),
            "gpt3-13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, seq_len=2048, tie_embeddings=True),
            "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, seq_len=2048, tie_embeddings=True),
        },
        {"default": 12, "small": _SMALL_BATCH, "tiny": _TINY_BATCH, "gpt3-1.3b": 1, "gpt3-6.7b": 1,
         "gpt3-13b": 1, "gpt3-175b": 1},
        _lm_inputs,
    ),
    # Not in the paper.  Default = LLaMA-3 8B (Dubey et al. 2024, "The Llama 3 Herd of Models",
    # Table 3: 32 layers, width 4096, FFN 14336, 32 heads, 8 key/value heads, vocabulary 128256,
    # RoPE theta 500000) at the paper's 8192-token pre-training context; batch 1 sequence per
    # GPU as torchtitan's train_configs/llama3_8b.toml (batch_size = 1, seq_len = 8192).
    # ~8.03B parameters (lm_head untied, as in LLaMA-3 8B).
    "llama": _Entry(
        "LLaMA-3 8B style decoder (32 x 4096, GQA 32/8 heads, SwiGLU 14336, RoPE, 128256 vocab)",
        Llama,
        {
            "default": LlamaConfig(),
            "small": LlamaConfig(n_layer=2, d_model=128, ffn_hidden=384, n_head=4, n_kv_head=2,
                                 vocab_size=1024, seq_len=32),
            "tiny": LlamaConfig(n_layer=2, d_model=16, ffn_hidden=32, n_head=4, n_kv_head=2,
                                vocab_size=50, seq_len=8),
        },
        {"default": 1, "small": _SMALL_BATCH, "tiny": _TINY_BATCH},
        _llama_inputs,
    ),
}


def names() -> tuple[str, ...]:
    """Names of every zoo model, in registry order."""
    return tuple(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown zoo model {name!r}; valid names: {', '.join(_REGISTRY)}"
        ) from None


def describe(name: str) -> str:
    """One-line description of model ``name``."""
    return _entry(name).description


def config(name: str, variant: str = "default", **overrides: Any) -> Any:
    """The frozen config dataclass of ``name``/``variant`` with ``overrides`` applied."""
    entry = _entry(name)
    if variant not in entry.configs:
        raise ValueError(
            f"unknown variant {variant!r} for zoo model {name!r}; valid variants: "
            f"{', '.join(entry.configs)}"
        )
    base = entry.configs[variant]
    allowed = [f.name for f in dataclasses.fields(base)]
    for key in overrides:
        if key not in allowed:
            raise ValueError(
                f"zoo model {name!r} has no config field {key!r}; allowed fields: "
                f"{', '.join(allowed)}"
            )
    return dataclasses.replace(base, **overrides)


def build(
    name: str,
    variant: str = "default",
    *,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    **overrides: Any,
) -> tuple[nn.Module, Inputs]:
    """Build zoo model ``name`` and example ``(inputs, targets)`` for it.

    ``batch_size`` defaults to the variant's batch; ``overrides`` replace config fields (see
    :func:`config`).  With ``device="meta"`` nothing is allocated, so paper-scale models are
    cheap.  Weights and inputs depend only on ``seed``; the global RNG state is left untouched.
    """
    entry = _entry(name)
    cfg = config(name, variant, **overrides)
    batch = entry.batch[variant] if batch_size is None else batch_size
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    dev = None if device is None else torch.device(device)
    accel = [dev] if dev is not None and dev.type not in ("cpu", "meta") else []
    device_type = dev.type if accel else "cuda"
    with torch.random.fork_rng(devices=accel, device_type=device_type):
        torch.manual_seed(seed)
        with dev if dev is not None else contextlib.nullcontext():
            model = entry.model(cfg)
            example = entry.inputs(cfg, batch)
    return model, example

