"""published_runs.py: the analytical cost model against published, measured GPU training runs
(issue 24). Each configuration is data (``Run``: model shape, devices, TP/PP/DP, micro-batch,
global batch, sequence length, recompute, dtype, the published figure and where it is printed);
the script builds the model on meta, the ``megatron`` baseline's plan with the row's flags
(full recompute of every block as ``plan --recompute``, bf16 as ``plan --dtype bf16``),
predicts the iteration with the analytical model (the row's attention kernel: "math" for
Megatron-LM of 2021) on the row's preset (a100-<N/8>x8) and prints
predicted vs published TFLOP/s per GPU and iteration seconds, the relative error, and Spearman's
ρ per sweep.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: GPT models of 1.7B-1T parameters on 32-3,072
A100 80GB GPUs of Selene (DGX A100 nodes: 8 GPUs on NVSwitch, 8 HDR InfiniBand NICs), vocabulary
51,200, sequence 2,048. Hidden size, layers, parameters, model-parallel size, GPUs, batch,
achieved TFLOP/s per GPU, % of peak and aggregate PFLOP/s as printed in that table and in
Megatron-LM's README of April 2021 (images/cases_april2021.png, commit 50a4b5f); heads and the
split of model-parallel size into tensor x pipeline (tensor 8 inside a DGX node, pipeline the
rest) as the paper's Table 1. Table 1 does not give the micro-batch: 1 sequence, the
``--micro-batch-size`` of Megatron-LM's GPT-3 175B example script, is assumed (``MICROBATCH``).
The published TFLOP/s count the paper's FLOPs, 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration
(its §5.1, with activation recomputation: every run of the table recomputes), so the predicted
TFLOP/s are that count over the predicted iteration; the published iteration seconds are the
same count over the published TFLOP/s.

Rows whose device count the presets do not reach (``simulator.cluster.MAX_DEVICES``) are
printed as "not simulated: N devices", never dropped.

    python benchmarks/published_runs.py            # every row the presets reach
    python benchmarks/published_runs.py --rows 3   # the first three rows
    python benchmarks/published_runs.py --rows 3 --attention flash   # as if FlashAttention ran
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.cost import ATTENTION_KERNELS, get_cost_model  # noqa: E402
from simulator.presets import get_topology  # noqa: E402
from simulator.result import SimResult  # noqa: E402
from soapsearch import trace  # noqa: E402
from soapsearch._models.transformer import GPT, GPTConfig  # noqa: E402
from soapsearch.calibrate import spearman  # noqa: E402
from soapsearch.search.api import Evaluator  # noqa: E402
from strategies import OpGraph, Strategy  # noqa: E402
from strategies.baselines import recomputed  # noqa: E402
from strategies.megatron import megatron  # noqa: E402

MICROBATCH = 1
"""Sequences per micro-batch (not in Table 1; Megatron-LM's GPT-3 175B example script's
``--micro-batch-size 1``)."""
NARAYANAN = "Narayanan et al. SC'21, Table 1"


@dataclass(frozen=True)
class Run:
    """One published training configuration and its measured throughput."""

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
    tflops: float
    """Published achieved TFLOP/s per GPU."""
    percent_peak: int
    """Published % of the theoretical peak (312 TFLOP/s bf16 on an A100)."""
    aggregate_pflops: float
    """Published aggregate PFLOP/s over all GPUs."""
    source: str
    sweep: str
    seq: int = 2048
    vocab: int = 51200
    microbatch: int = MICROBATCH
    recompute: bool = True
    dtype: str = "bf16"
    device: str = "a100"
    attention: str = "math"
    """The attention kernel (``simulator.cost.ATTENTION_KERNELS``): Megatron-LM of 2021 ran
    q·kᵀ (baddbmm), its fused scale-mask-softmax and ·v (bmm) as separate kernels, the scores
    in HBM; FlashAttention (Dao et al. 2022) came a year later."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel rank and iteration: B / (DP · micro-batch)."""
        return self.batch // (self.dp * self.microbatch)

    @property
    def topology(self) -> str:
        return f"{self.device}-{self.gpus // 8}x8"


ROWS: tuple[Run, ...] = tuple(
    Run(name, p, a, h, l, t, pp, n, b, f, pct, agg, f"{NARAYANAN}, row {name}", "narayanan-table1")
    for name, p, a, h, l, t, pp, n, b, f, pct, agg in (
        # name, params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s/GPU, % peak, PFLOP/s
        ("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
        ("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
        ("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
        ("18B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
        ("39B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
        ("76B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
        ("145B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
        ("310B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
        ("530B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
        ("1T", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
    ))


def narayanan_flops(run: Run) -> float:
    """FLOPs of one iteration as Narayanan et al. §5.1 count them (with recomputation):
    96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    b, s, l, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def narayanan_params(run: Run) -> float:
    """Parameters of the shape as Narayanan et al. §5.1 count them: 12·l·h²·(1 + 13/12h + (V+s)/12lh)."""
    l, h = run.layers, run.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (run.vocab + run.seq) / (12 * l * h))


def published_seconds(run: Run) -> float:
    """The iteration the published TFLOP/s per GPU imply: the paper's FLOPs / (GPUs · TFLOP/s)."""
    return narayanan_flops(run) / (run.gpus * run.tflops * 1e12)


def build_graph(run: Run) -> OpGraph:
    """The row's GPT on meta (zoo gpt's module at the row's shape: tied embeddings, learned
    positions, the paper's vocabulary; dropout 0, which costs nothing on meta), the whole global
    batch as the traced batch."""
    cfg = GPTConfig(n_layer=run.layers, n_head=run.heads, n_embd=run.hidden, seq_len=run.seq,
                    vocab_size=run.vocab, dropout=0.0, tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(cfg)
        tokens = torch.zeros(run.batch, run.seq, dtype=torch.long)
    return trace(model, (tokens, tokens), name=f"gpt-{run.name}")


def build_plan(run: Run, graph: OpGraph) -> Strategy:
    """The ``megatron`` baseline with the row's TP, PP and micro-batches (1F1B), every block
    recomputed (``plan --recompute``) and the row's dtype."""
    plan = megatron(graph, run.gpus, tp=run.tp, pp=run.pp, microbatches=run.microbatches)
    if run.recompute:
        plan = recomputed(plan, graph)
    return plan.with_precision(run.dtype)


def reachable(run: Run) -> str | None:
    """None when the presets reach the row's devices, else why not ("not simulated: N devices")."""
    try:
        get_topology(run.topology)
    except ValueError:
        return f"not simulated: {run.gpus} devices"
    return None


def predict(run: Run, graph: OpGraph | None = None) -> SimResult:
    """The analytical model's simulation of the row's plan on its preset (Adam, as Megatron-LM)."""
    graph = build_graph(run) if graph is None else graph
    cost = get_cost_model("analytical", attention=run.attention)
    evaluate = Evaluator(graph, get_topology(run.topology), cost, "adam", precision=run.dtype)
    return evaluate(build_plan(run, graph))


def predicted_tflops(run: Run, result: SimResult) -> float:
    """TFLOP/s per GPU the prediction implies, counted as the paper counts them."""
    return narayanan_flops(run) / (run.gpus * result.iteration_time) / 1e12


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=len(ROWS), help="the first N rows of the table")
    ap.add_argument("--attention", choices=ATTENTION_KERNELS, help="every row with this attention kernel")
    args = ap.parse_args(argv)
    rows = ROWS[:args.rows] if args.attention is None else \
        tuple(replace(r, attention=args.attention) for r in ROWS[:args.rows])
    print(f"{'row':6s} {'GPUs':>5s} {'TP':>3s} {'PP':>3s} {'DP':>4s} {'B':>5s} {'M':>4s} {'pub s':>7s} "
          f"{'pred s':>7s} {'pub TF':>6s} {'pred TF':>7s} {'error':>7s} {'sim s':>6s}  source", flush=True)
    errors: dict[str, list[tuple[float, float, float]]] = {}
    for run in rows:
        head = (f"{run.name:6s} {run.gpus:5d} {run.tp:3d} {run.pp:3d} {run.dp:4d} {run.batch:5d} "
                f"{run.microbatches:4d} {published_seconds(run):7.2f}")
        if (why := reachable(run)) is not None:
            print(f"{head} {'-':>7s} {run.tflops:6.0f} {'-':>7s} {'-':>7s} {'-':>6s}  {run.source}; {why}", flush=True)
            continue
        t0 = time.perf_counter()
        result = predict(run)
        tf = predicted_tflops(run, result)
        err = tf / run.tflops - 1
        errors.setdefault(run.sweep, []).append((err, tf, run.tflops))
        print(f"{head} {result.iteration_time:7.2f} {run.tflops:6.0f} {tf:7.1f} {err:+7.1%} "
              f"{time.perf_counter() - t0:6.1f}  {run.source}{'' if result.fits else '; does not fit'}", flush=True)
    every = [abs(e) for rows in errors.values() for e, _, _ in rows]
    if every:
        print(f"|error| over {len(every)} rows: median {statistics.median(every):.1%}, max {max(every):.1%}")
    for sweep, rows in errors.items():
        rho = spearman([p for _, p, _ in rows], [m for _, _, m in rows])
        print(f"Spearman rho, {sweep} ({len(rows)} rows): {rho:.2f}")


if __name__ == "__main__":
    main()
