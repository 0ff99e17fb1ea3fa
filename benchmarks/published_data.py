"""Published, measured GPU training runs as data: each configuration (model shape, devices,
TP/PP/DP, micro-batch, global batch, sequence length, recompute, dtype), its published figure
and where it is printed (paper, table, row). ``benchmarks/published_runs.py`` predicts them.

Sources (each figure read from the paper's own text, arXiv versions):

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21 (arXiv 2104.04473), §5.1 Table 1: GPT models of 1.7B-1T parameters on
  32-3,072 A100 80GB GPUs of Selene (DGX A100 nodes: 8 GPUs on NVSwitch, 8 HDR InfiniBand NICs),
  vocabulary 51,200, sequence 2,048, mixed precision; every column (parameters, attention
  heads, hidden size, layers, tensor- and pipeline-parallel size, GPUs, batch, achieved TFLOP/s
  per GPU, % of peak, aggregate PFLOP/s) as printed there. §5.1: "we use the interleaved
  pipeline schedule with the scatter/gather optimization enabled"; the paper gives no chunks
  per device, so they are read from the paper's own launch script in Megatron-LM
  (examples/academic_paper_scripts/sc21/run_table_1.sh, ``--num-layers-per-virtual-pipeline-stage``
  n: v = layers / (PP · n)): 76B 3, 145B 2, 310B 2, 530B 3; 39B and 1T run without it (1F1B).
  Its FLOPs, equation (3), count activation recomputation. Table 1 gives no
  micro-batch size nor data-parallel implementation: both are the same script's (``MBS``:
  1.7B-7.5B 16, 18B 8, 39B 4, 76B and 145B 2, the rest 1; ``--DDP-impl``: ``torch`` up to
  18B, ``local`` from 39B), and its CONFIG.sh runs ``--fp16``.
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys'23
  (arXiv 2205.05198), Table 3 (configurations: heads, hidden, layers, TP, PP, GPUs, global and
  micro-batch) and Table 5 (end-to-end iteration seconds with full recompute and with "present
  work", sequence parallelism + selective recompute; model FLOPs utilization of the latter);
  §6: sequence 2,048, vocabulary 51,200, mixed precision, Selene, no data parallelism, the
  interleaved schedule with 3 chunks per device for 175B and 530B.
- torchtitan's docs/performance.md of 2024 ("LLaMa 3 performance numbers", "LLaMa 2 performance
  numbers"): LLaMA-2 13B/70B and LLaMA-3 8B/70B trained with FSDP2 on 64 A100 80GB GPUs, local
  batch 1 or 2, tokens per second per GPU (WPS) and MFU per activation-checkpointing setting;
  sequence 8,192 (LLaMA-3) or 4,096 (LLaMA-2), bf16 mixed precision, SDPA attention (flash).
  Shapes: LLaMA-3 as Dubey et al. 2024 Table 3, LLaMA-2 as Touvron et al. 2023 (the released
  configurations); each reproduces the printed MFU with torchtitan's count of 6·N + 12·l·h·s
  FLOPs a token over 312 TFLOP/s. The published cluster's network is not described; rows are
  predicted on DGX A100 nodes (a100-8x8).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DDP_IMPLS", "MICROBATCH", "RECOMPUTE", "ROWS", "Run", "NARAYANAN", "NARAYANAN_CHUNKS", "KORTHIKANTI", "TORCHTITAN"]

MICROBATCH = 1
"""Sequences per micro-batch of a row that names none (every source here names its own)."""
DDP_IMPLS = ("torch", "local")
"""Megatron-LM's ``--DDP-impl``: "torch", ``DistributedDataParallel`` (Li et al. 2020: 25 MiB
buckets, each all-reduced once its gradients are final, overlapping the backward of the last
micro-batch; Megatron-LM runs the others under ``no_sync``), or "local", Megatron-LM's own
``DistributedDataParallel`` (megatron/model/distributed.py: the gradients in one contiguous
buffer, all-reduced by ``allreduce_gradients`` after the backward of the last micro-batch,
nothing overlapped)."""
RECOMPUTE = ("full", "selective", "alternate", "op", "none")
"""Activation recomputation (Korthikanti et al. §5): every op of every transformer block
("full", ``plan --recompute``), the attention core only ("selective"), every block of every
second layer ("alternate": torchtitan's selective layer checkpointing, ``selective_ac_option
= "2"``), torchtitan's selective op checkpointing ("op": its save list, every second matrix
product and every op but the attention cores and the other products recomputed in each layer,
``strategies.recompute_policies.op_recomputed``), or none."""
NARAYANAN = "Narayanan et al. SC'21 (arXiv 2104.04473), Table 1"
KORTHIKANTI = "Korthikanti et al. MLSys'23 (arXiv 2205.05198), Tables 3 and 5"
TORCHTITAN = "torchtitan docs/performance.md (2024), 64 A100 80GB"


@dataclass(frozen=True)
class Run:
    """One published training configuration and its measured figure (TFLOP/s per GPU or
    iteration seconds, whichever the source prints)."""

    name: str
    params_b: float
    """Parameters, billions, as published."""
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    """Global batch, sequences per iteration."""
    source: str
    """Paper, table and row the figures are printed in."""
    sweep: str
    """Rows that vary one setting of one source; Spearman's ρ is taken within each."""
    tflops: float | None = None
    """Published achieved TFLOP/s per GPU (Narayanan: its equation (3) FLOPs / time / GPUs)."""
    seconds: float | None = None
    """Published iteration seconds (Korthikanti Table 5)."""
    percent_peak: float | None = None
    """Published % of the theoretical peak (312 TFLOP/s bf16 on an A100)."""
    aggregate_pflops: float | None = None
    """Published aggregate PFLOP/s over all GPUs."""
    mfu: float | None = None
    """Published model FLOPs utilization, % (Korthikanti Table 5, torchtitan)."""
    wps: float | None = None
    """Published tokens per second per GPU (torchtitan's WPS)."""
    model: str = "gpt"
    """The model built: "gpt" (zoo gpt's module) or "llama" (zoo llama's: RMSNorm, RoPE,
    SwiGLU of ``ffn``, ``kv_heads`` key/value heads, untied output)."""
    ffn: int | None = None
    kv_heads: int | None = None
    plan: str = "megatron"
    """The baseline the run used: "megatron" (TP/PP/DP) or "fsdp" (FSDP2 over every GPU)."""
    seq: int = 2048
    vocab: int = 51200
    microbatch: int = MICROBATCH
    recompute: str = "full"
    """One of ``RECOMPUTE``."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al. §4.2.2): the ops between the blocks
    cut on the sequence (``megatron(sequence_parallel=True)``)."""
    chunks: int = 1
    """Model chunks per device of the published pipeline schedule: 1 for 1F1B, v > 1 for
    interleaved 1F1B (Narayanan et al. §2.2.2), run as ``megatron(virtual_stages=v)``."""
    dtype: str = "bf16"
    reduce_dtype: str = "compute"
    """What the run sums gradients in (``Strategy.reduce_dtype``): ``compute`` (Megatron-LM's
    DDP all-reduces fp16 gradients in fp16) or ``float32`` (Megatron-LM under ``--bf16``: its
    arguments.py sets ``accumulate_allreduce_grads_in_fp32``; torchtitan's FSDP2:
    ``MixedPrecisionPolicy(reduce_dtype=float32)`` from its ``training.mixed_precision_reduce``,
    default and only choice "float32", torchtitan/config/job_config.py)."""
    ddp: str = "torch"
    """How the data-parallel gradients are all-reduced: one of ``DDP_IMPLS``."""
    device: str = "a100"
    attention: str = "megatron"
    """The attention kernel (``simulator.cost.ATTENTION_KERNELS``): Megatron-LM of 2021-2022 ran
    q·kᵀ (baddbmm), its fused scale-mask-softmax, dropout on the probabilities (its default
    ``--attention-dropout 0.1``) and ·v (bmm) as separate kernels, the scores in HBM;
    FlashAttention (Dao et al. 2022) reached Megatron-LM later."""
    input_grad_overlap: bool = False
    """Whether the run's column-parallel linears all-reduce (or, with sequence parallelism,
    reduce-scatter) their input gradient while computing their weight gradient
    (``simulator.cost.CostModel.input_grad_overlap``): Megatron-LM's asynchronous
    tensor-parallel communication, on by default since ``--no-async-tensor-model-parallel-allreduce``
    was added; Korthikanti et al.'s sequence parallelism is built on it (its column-parallel
    linear gathers its input and reduce-scatters its input gradient inside one autograd function,
    ``LinearWithGradAccumulationAndAsyncCommunication``). Table 1's rows: False, as n½ was
    fitted on them (their launch script, run_table_1.sh, names no such flag; whether the code of
    the 2021 runs had it is not established here)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank and iteration: B / (DP · micro-batch)."""
        return self.batch // (self.dp * self.microbatch)

    @property
    def topology(self) -> str:
        return f"{self.device}-{max(self.gpus // 8, 1)}x{min(self.gpus, 8)}"


NARAYANAN_CHUNKS = {"76B": 3, "145B": 2, "310B": 2, "530B": 3}
"""Table 1's chunks per device (the module docstring: run_table_1.sh's layers per virtual stage);
the other rows run 1F1B (or no pipeline)."""

_NARAYANAN_ROWS = tuple(
    Run(name, p, a, h, l, t, pp, n, b, f"{NARAYANAN}, row {name}", "narayanan-table1", tflops=f,
        percent_peak=pct, aggregate_pflops=agg, chunks=NARAYANAN_CHUNKS.get(name, 1), microbatch=mbs, ddp=ddp,
        dtype="fp16")
    for name, p, a, h, l, t, pp, n, b, f, pct, agg, mbs, ddp in (
        # name, params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s/GPU, % peak, PFLOP/s;
        # run_table_1.sh: micro-batch (MBS), --DDP-impl (DDP)
        ("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, 16, "torch"),
        ("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, 16, "torch"),
        ("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, 16, "torch"),
        ("18B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, 8, "torch"),
        ("39B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, 4, "local"),
        ("76B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, 2, "local"),
        ("145B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, 2, "local"),
        ("310B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, 1, "local"),
        ("530B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, 1, "local"),
        ("1T", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, 1, "local"),
    ))

_KORTHIKANTI_ROWS = tuple(
    Run(f"{name} {label}", p, a, h, l, t, pp, n, b, f"{KORTHIKANTI}, row {name}, {column}", f"korthikanti-{name}",
        seconds=s, mfu=mfu, microbatch=mb, recompute=rec, sequence_parallel=sp, chunks=v, input_grad_overlap=True,
        reduce_dtype="float32")
    for name, p, a, h, l, t, pp, n, b, mb, v, full_s, present_s, mfu_present in (
        # Table 3: size, heads, hidden, layers, TP, PP, GPUs, batch, micro-batch; §6: chunks;
        # Table 5: iteration s with full recompute, with present work; MFU % of present work
        ("22B", 22, 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 41.5),
        ("175B", 175, 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 51.4),
        ("530B", 530, 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 56.0),
        ("1T", 1000, 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 56.3),
    )
    for label, column, s, mfu, rec, sp in (
        ("full", "full recompute", full_s, None, "full", False),
        ("sel+sp", "present work (selective recompute + sequence parallelism)", present_s, mfu_present,
         "selective", True),
    ))

_TORCHTITAN_ROWS = tuple(
    Run(name, p, a, h, l, 1, 1, 64, 64 * local, f"{TORCHTITAN}, {table}, row {name}", "torchtitan-a100",
        wps=wps, mfu=mfu, seq=seq, vocab=v, microbatch=local, recompute=rec,
        dtype="bf16", reduce_dtype="float32", attention="flash",
        model="llama", ffn=f,
        kv_heads=kv, plan="fsdp")
    for name, table, p, a, kv, h, l, f, v, seq, local, rec, wps, mfu in (
        # name, table, params (B), heads, kv heads, hidden, layers, ffn, vocab, seq,
        # local batch, checkpointing, WPS, MFU %
        ("LLaMA-3 8B layer", "LLaMa 3", 8.0, 32, 8, 4096, 32, 14336, 128256, 8192, 1, "alternate",
         2876, 56.3),
        ("LLaMA-3 8B op", "LLaMa 3", 8.0, 32, 8, 4096, 32, 14336, 128256, 8192, 1, "op", 2973, 58.2),
        ("LLaMA-3 70B full", "LLaMa 3", 70.6, 64, 8, 8192, 80, 28672, 128256, 8192, 1, "full",
         323, 50.5),
        ("LLaMA-2 13B none", "LLaMa 2", 13.0, 40, 40, 5120, 40, 13824, 32000, 4096, 2, "none",
         2162, 61.1),
        ("LLaMA-2 13B layer", "LLaMa 2", 13.0, 40, 40, 5120, 40, 13824, 32000, 4096, 2, "alternate",
         1914, 54.1),
        ("LLaMA-2 13B op", "LLaMa 2", 13.0, 40, 40, 5120, 40, 13824, 32000, 4096, 2, "op", 1904, 53.8),
        ("LLaMA-2 70B op", "LLaMa 2", 69.0, 64, 8, 8192, 80, 28672, 32000, 4096, 1, "op", 355, 50.8),
        ("LLaMA-2 70B full", "LLaMa 2", 69.0, 64, 8, 8192, 80, 28672, 32000, 4096, 2, "full",
         353, 50.5),
    ))

ROWS: tuple[Run, ...] = _NARAYANAN_ROWS + _KORTHIKANTI_ROWS + _TORCHTITAN_ROWS
"""Every published row: Narayanan's Table 1 first (in its order), then Korthikanti's, then
torchtitan's."""
