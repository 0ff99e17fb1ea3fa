"""published_runs.py: the analytical cost model against published, measured GPU training runs
(issue 24). The runs are data (``benchmarks/published_data.py``: shape, devices, TP/PP/DP,
micro-batch, global batch, sequence, recompute, dtype, the published figure and its paper,
table and row); this script builds each row's model on meta, the ``megatron`` baseline's plan
with the row's flags (full recompute of every block as ``plan --recompute``, selective
recompute as the attention cores recomputed, torchtitan's selective op checkpointing as
``strategies.recompute_policies.op_recomputed``, sequence parallelism, bf16 or fp16 as ``plan
--dtype``, Megatron-LM's local DDP as one gradient bucket synced after the backward and its
sends: ``LOCAL_DDP_BUCKET_MB``), predicts the iteration with the analytical model (the row's attention kernel:
"megatron" for Megatron-LM of 2021-2022, its unfused kernels with dropout on the
probabilities; torchtitan's "flash" at FlashAttention-2's published rates,
``simulator.attention_efficiency``; Korthikanti's rows with Megatron-LM's asynchronous tensor-parallel communication,
``Run.input_grad_overlap``: ``row_cost``) on the row's preset (a100-<N/8>x8) and prints predicted vs
published iteration seconds, TFLOP/s per GPU where the source prints them, the relative error
of the throughput (published / predicted seconds - 1), Spearman's ρ per sweep, and a
diagnostic: "waves", the tile and wave quantization efficiency of a layer's GEMMs per GPU
(``block_wave_efficiency``; the cost model charges it on the presets with SMs,
``simulator.gemm_shape``). Memory, GiB: the predicted peak of the
worst GPU ("peak", against the preset's 80 GiB: "does not fit" past it), its activations
("act") and Korthikanti et al.'s count of the activations a GPU holds ("paper",
``korthikanti_activations``).

Narayanan et al.'s TFLOP/s count their FLOPs, 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration
(§5.1 equation (3), with activation recomputation), so the predicted TFLOP/s are that count
over the predicted iteration and the published iteration seconds that count over the
published TFLOP/s. Korthikanti et al. print iteration seconds (Table 5).

Rows over ``--max-gpus`` devices (default 128: what the simulator runs in a few minutes on a
2-core machine) or past the presets are printed as "not simulated: N devices", never dropped.

    python benchmarks/published_runs.py                   # every row of <= 128 GPUs
    python benchmarks/published_runs.py --sweep narayanan-table1 --max-gpus 64
    python benchmarks/published_runs.py --row 7.5B --row "22B full"
    python benchmarks/published_runs.py --attention flash  # as if FlashAttention ran
    python benchmarks/published_runs.py --row 39B --max-gpus 512 --chunks 3  # interleaved, as §5.1 says
    python benchmarks/published_runs.py --row 1.7B --shares  # one layer's time by op kind
    python benchmarks/published_runs.py --row 18B --max-gpus 512 --breakdown  # device 0's iteration by part
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published_breakdown import breakdown  # noqa: E402
from benchmarks.published_data import MICROBATCH, ROWS, Run  # noqa: E402
from simulator.cost import ATTENTION_KERNELS, CostModel, get_cost_model  # noqa: E402
from simulator.gemm_shape import tile_wave_efficiency  # noqa: E402
from simulator.presets import NCCL_OVERLAP_RATE, get_topology  # noqa: E402
from simulator.result import SimResult  # noqa: E402
from simulator.topology import Topology  # noqa: E402
from soapsearch import trace  # noqa: E402
from soapsearch._models.llama import Llama, LlamaConfig  # noqa: E402
from soapsearch._models.transformer import GPT, GPTConfig  # noqa: E402
from soapsearch.calibrate import spearman  # noqa: E402
from soapsearch.search.api import Evaluator  # noqa: E402
from strategies import OpGraph, Strategy  # noqa: E402
from strategies.baselines import fsdp  # noqa: E402
from strategies import megatron_layers  # noqa: E402
from strategies.megatron import megatron  # noqa: E402
from strategies.megatron_layers import layer_recomputed  # noqa: E402
from strategies.recompute_policies import attention_recomputed, op_recomputed  # noqa: E402
from strategies.lowering import lower  # noqa: E402
from strategies.precision import compute_graph  # noqa: E402

__all__ = ["MICROBATCH", "ROWS", "Run", "block_wave_efficiency", "build_graph", "build_plan",
           "korthikanti_activations", "korthikanti_model_flops", "layer_ops", "layer_products", "layer_shares",
           "llama_params", "narayanan_flops", "narayanan_params", "predict", "predicted_mfu", "predicted_tflops",
           "published_seconds", "reachable", "row_cost", "row_topology", "throughput_error", "tile_wave_efficiency",
           "torchtitan_flops"]

GiB = 1 << 30
LOCAL_DDP_BUCKET_MB = float(1 << 30)
"""Megatron-LM's local DDP (``published_data.DDP_IMPLS``) as a plan: a bucket cap past any gradient, so
each device set's gradients but DDP's first 1 MiB bucket form one bucket, and
``overlap_grad_reduce`` False: all-reduced after the last backward step and its pipeline sends,
as ``allreduce_gradients`` runs once the schedule has returned."""
MAX_GPUS = 128
"""Rows of more devices are listed, not simulated, unless ``--max-gpus`` says otherwise."""


def narayanan_flops(run: Run) -> float:
    """FLOPs of one iteration as Narayanan et al. §5.1 count them (with recomputation):
    96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    b, s, l, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def narayanan_params(run: Run) -> float:
    """Parameters of the shape as Narayanan et al. §5.1 count them: 12·l·h²·(1 + 13/12h + (V+s)/12lh)."""
    l, h = run.layers, run.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (run.vocab + run.seq) / (12 * l * h))


def korthikanti_model_flops(run: Run) -> float:
    """Model FLOPs of one iteration as Korthikanti et al. Appendix A count them (no
    recomputation): 72·B·L·s·h²·(1 + s/6h + V/12hL), their equation (7)."""
    b, s, l, h, v = run.batch, run.seq, run.layers, run.hidden, run.vocab
    return 72 * b * l * s * h * h * (1 + s / (6 * h) + v / (12 * h * l))


def llama_params(run: Run) -> float:
    """Parameters of a LLaMA shape: embedding and untied output V·h each, per layer q and o h²,
    k and v h·(kv heads · head dim), the SwiGLU's 3·h·ffn and two RMSNorms, a final RMSNorm."""
    h, kv = run.hidden, run.kv_heads * (run.hidden // run.heads)
    return 2 * run.vocab * h + run.layers * (2 * h * h + 2 * h * kv + 3 * h * run.ffn + 2 * h) + h


def torchtitan_flops(run: Run) -> float:
    """FLOPs of one iteration as torchtitan counts them for MFU (its train.py, after the PaLM
    paper's appendix B): (6·N + 12·l·h·s) a token."""
    return (6 * llama_params(run) + 12 * run.layers * run.hidden * run.seq) * run.batch * run.seq


def published_seconds(run: Run) -> float:
    """The published iteration seconds: as printed; else the sequences' tokens over the GPUs'
    published tokens/s (torchtitan); else the paper's FLOPs / (GPUs · TFLOP/s) (Narayanan)."""
    if run.seconds is not None:
        return run.seconds
    if run.wps is not None:
        return run.batch * run.seq / (run.gpus * run.wps)
    return narayanan_flops(run) / (run.gpus * run.tflops * 1e12)


def build_graph(run: Run) -> OpGraph:
    """The row's model on meta (zoo gpt's module at the row's shape: tied embeddings, learned
    positions, the paper's vocabulary, dropout 0, which costs nothing on meta, and Megatron-LM's
    one query-key-value linear of width 3h, ``GPTConfig.fused_qkv``: ``megatron/model/
    transformer.py`` ParallelAttention.query_key_value, a ColumnParallelLinear of 3·projection
    size; or zoo llama's, whose wq, wk, wv are torchtitan's separate linears), the whole global
    batch as the traced batch."""
    with torch.device("meta"):
        if run.model == "llama":
            model = Llama(LlamaConfig(n_layer=run.layers, d_model=run.hidden, ffn_hidden=run.ffn, n_head=run.heads,
                                      n_kv_head=run.kv_heads, vocab_size=run.vocab, seq_len=run.seq))
        else:
            model = GPT(GPTConfig(n_layer=run.layers, n_head=run.heads, n_embd=run.hidden, seq_len=run.seq,
                                  vocab_size=run.vocab, dropout=0.0, tie_embeddings=True, fused_qkv=True))
        tokens = torch.zeros(run.batch, run.seq, dtype=torch.long)
    return trace(model, (tokens, tokens), name=f"gpt-{run.params_b:g}b")


def build_plan(run: Run, graph: OpGraph) -> Strategy:
    """The row's baseline: ``megatron`` with its TP, PP, sequence parallelism, micro-batches
    and chunks per device (1F1B, or interleaved 1F1B where ``chunks`` > 1), or ``fsdp`` over
    every GPU; its recompute (full: every layer but its closing residual add, ``layer_ops``;
    selective: each attention core, Korthikanti et al. §5; alternate: every second layer's,
    torchtitan's selective layer checkpointing; op: torchtitan's selective op checkpointing,
    ``strategies.recompute_policies.op_recomputed``), its dtype and the dtype it sums gradients in
    (``Run.reduce_dtype``: torchtitan's FSDP2 in float32)."""
    if run.plan == "fsdp":
        plan = fsdp(graph, run.gpus)
    else:
        plan = megatron(graph, run.gpus, tp=run.tp, pp=run.pp, microbatches=run.microbatches,
                        sequence_parallel=run.sequence_parallel, virtual_stages=run.chunks)
    if run.recompute in ("full", "alternate"):
        layers = layer_ops(graph, run)  # "alternate": torchtitan's 2nd, 4th, ...
        plan = layer_recomputed(plan, graph, layers[1::2] if run.recompute == "alternate" else layers)
    elif run.recompute == "op":
        plan = op_recomputed(plan, graph, layer_ops(graph, run))
    elif run.recompute == "selective":
        plan = attention_recomputed(plan, graph)
    if run.ddp == "local":
        plan = plan.with_bucket_cap(LOCAL_DDP_BUCKET_MB).with_overlap_grad_reduce(False)
    return plan.with_precision(run.dtype, run.reduce_dtype)


def layer_ops(graph: OpGraph, run: Run) -> list[set[str]]:
    """The recomputable ops of each transformer layer but its closing residual add, whose output,
    the next layer's input, is what full recompute keeps (``strategies.megatron_layers.layer_ops``:
    Megatron-LM's and torchtitan's checkpoint of a whole layer; Korthikanti et al. 2022 §4.1:
    2sbh a layer); a ValueError where the graph's layers are not the row's."""
    layers = megatron_layers.layer_ops(graph)
    if len(layers) != run.layers:
        raise ValueError(f"row {run.name!r}: {len(layers)} layers in the graph for {run.layers}")
    return layers


def reachable(run: Run, max_gpus: int | None = None) -> str | None:
    """None when the row is simulated: its devices within ``max_gpus`` (None: no limit) and the
    presets; else why not ("not simulated: N devices ...")."""
    if max_gpus is not None and run.gpus > max_gpus:
        return f"not simulated: {run.gpus} devices (over --max-gpus {max_gpus})"
    try:
        get_topology(run.topology)
    except ValueError:
        return f"not simulated: {run.gpus} devices (past the presets)"
    return None


def row_topology(run: Run) -> Topology:
    """The row's preset with its compute slowed beside its own collectives
    (``DeviceSpec.overlap_rate`` = ``simulator.presets.NCCL_OVERLAP_RATE``, Lee et al. 2025),
    which the presets leave off for the search's speed."""
    topology = get_topology(run.topology)
    return replace(topology, devices=tuple(replace(d, overlap_rate=NCCL_OVERLAP_RATE) for d in topology.devices))


def row_cost(run: Run) -> CostModel:
    """The analytical model as the row's software ran: its attention kernel, whether its
    tensor-parallel input gradients' collectives overlap the weight gradients
    (``Run.input_grad_overlap``) and, for FSDP2's rows, FSDP2's copies on the compute stream
    (``CostModel.fsdp_copies``: each all-gather's copy-out, each reduce-scatter's copy-in)."""
    return get_cost_model("analytical", attention=run.attention, input_grad_overlap=run.input_grad_overlap,
                          fsdp_copies=run.plan == "fsdp")


def predict(run: Run, graph: OpGraph | None = None, topology: Topology | None = None,
            summary: bool = False) -> SimResult:
    """The analytical model's simulation of the row's plan on its preset (Adam, as Megatron-LM),
    or on ``topology`` (the preset with other device figures: ``benchmarks/published_fit.py``);
    ``summary``: with the memory breakdown (``SimResult.memory``)."""
    graph = build_graph(run) if graph is None else graph
    cost = row_cost(run)
    topology = row_topology(run) if topology is None else topology
    evaluate = Evaluator(graph, topology, cost, "adam", precision=run.dtype)
    return evaluate(build_plan(run, graph), summary=summary)


def korthikanti_activations(run: Run) -> float | None:
    """Activation bytes per GPU at 16 bits as Korthikanti et al. 2022 §4 count a GPT layer
    (s sequence, b micro-batch, h hidden, a heads, t TP): sbh·(10 + 24/t + 5as/ht) without
    recompute (their eq. 4; eq. 2's 34 + 5as/h at t = 1; without the 5as/ht of the attention
    scores and softmax under flash attention, which keeps none), 34·sbh/t with selective recompute
    and sequence parallelism (eq. 6), 2sbh with full recompute (§4.3: the layer's input; /t
    with sequence parallelism); over the L/p layers of a stage times the p micro-batches 1F1B's
    first stage holds, that is L layers (§4.2.3); torchtitan's "alternate": half the layers
    each way. A LLaMA layer's SwiGLU and GQA differ from the GPT layer counted here. For
    torchtitan's selective op checkpointing ("op", no GPT count), what its policy saves of a
    LLaMA layer (t = 1): the layer's input and the outputs of wq, wv, the attention, w1 and w2,
    sb·(4h + kv + f) at 16 bits (kv the key/value width, f the SwiGLU width), and the
    attention's float32 logsumexp, 4·sba bytes (``strategies.recompute_policies``)."""
    s, b, h, a, t = run.seq, run.microbatch, run.hidden, run.heads, run.tp
    if run.recompute == "op":
        kv = (run.kv_heads or a) * (h // a)
        return (2 * s * b * (4 * h + kv + run.ffn) + 4 * s * b * a) * run.layers
    sbh = s * b * h
    scores = 0 if run.attention == "flash" else 5 * a * s / (h * t)  # flash attention keeps no scores
    none = sbh * (10 + 24 / t + scores)
    full = 2 * sbh / (t if run.sequence_parallel else 1)
    per_layer = {"none": none, "full": full, "alternate": (none + full) / 2,
                 "selective": 34 * sbh / t if run.sequence_parallel else sbh * (10 + 24 / t)}[run.recompute]
    return per_layer * run.layers


def predicted_mfu(run: Run, result: SimResult) -> float:
    """Model FLOPs utilization, %, the prediction implies, counted as torchtitan counts it."""
    peak = get_topology(run.topology).devices[0].flops_for("bfloat16")
    return 100 * torchtitan_flops(run) / (result.iteration_time * run.gpus * peak)


def predicted_tflops(run: Run, result: SimResult) -> float:
    """TFLOP/s per GPU the prediction implies, counted as Narayanan et al. count them."""
    return narayanan_flops(run) / (run.gpus * result.iteration_time) / 1e12


def throughput_error(run: Run, result: SimResult) -> float:
    """Relative error of the predicted throughput: published / predicted seconds - 1 (for a
    TFLOP/s row: predicted / published TFLOP/s - 1)."""
    return published_seconds(run) / result.iteration_time - 1


def layer_products(run: Run) -> list[tuple[int, int, int]]:
    """(rows, out, in) of each linear of one transformer layer on one GPU: q/k/v, projection, MLP
    up (a SwiGLU's two) and down at the row's TP, micro-batch · sequence rows."""
    rows, h, t = run.microbatch * run.seq, run.hidden, run.tp
    kv = h if run.kv_heads is None else run.kv_heads * (h // run.heads)
    ffn = 4 * h if run.ffn is None else run.ffn
    ups = 1 if run.model == "gpt" else 2  # a SwiGLU's two up products
    return [(rows, out, inner) for out, inner in (((h + 2 * kv) // t, h), (h, h // t), *[(ffn // t, h)] * ups,
                                                  (h, ffn // t))]


def block_wave_efficiency(run: Run) -> float:
    """FLOP-weighted tile and wave efficiency of one transformer layer's GEMMs per GPU
    (``layer_products``), each forward (rows × out) and both backward products (rows × in,
    out × in). The quantization ``simulator.gemm_shape`` charges, without its rate over K."""
    flops = weighted = 0.0
    if not (sms := get_topology(run.topology).devices[0].sms):
        raise ValueError(f"row {run.name!r}: topology {run.topology!r} has sms=0; quantization needs sms >= 1")
    for rows, out, inner in layer_products(run):
        for m, n in ((rows, out), (rows, inner), (out, inner)):
            flops += rows * out * inner
            weighted += rows * out * inner / tile_wave_efficiency(m, n, sms)
    return flops / weighted


def layer_shares(run: Run) -> dict[str, tuple[int, float, float]]:
    """What the cost model charges one transformer layer of the row on device 0 for one
    micro-batch, by op kind: kind -> (partitions, forward s, backward s); the row's shape, plan,
    dtype and attention kernel at two layers and one pipeline stage (the second layer's ops,
    from its first to its closing residual add)."""
    small = replace(run, layers=2, pp=1, gpus=run.gpus // run.pp, batch=run.dp * run.microbatch, chunks=1)
    graph = build_graph(small)
    plan = build_plan(small, graph)
    lowered = lower(graph, plan)
    graph = compute_graph(graph, plan.compute_dtype)
    cost = row_cost(run)
    device = get_topology(run.topology).devices[0]
    names = [n.name for n in graph]
    layer = layer_ops(graph, small)[1]
    out: dict[str, tuple[int, float, float]] = {}
    for node in graph.nodes[min(map(names.index, layer)):max(map(names.index, layer)) + 2]:
        for p in (p for p in lowered.partitions[node.name][0] if p.device == 0):
            f, b = cost.partition_time(node, p, device)
            n, f0, b0 = out.get(node.kind, (0, 0.0, 0.0))
            out[node.kind] = (n + 1, f0 + f, b0 + b)
    return out


def _print_shares(run: Run) -> None:
    shares = layer_shares(run)
    fwd, bwd = (sum(t[i] for t in shares.values()) for i in (1, 2))
    print(f"{run.name}: one layer, device 0, one micro-batch ({run.attention} attention): forward "
          f"{fwd * 1e3:.3f} ms, backward {bwd * 1e3:.3f} ms")
    print(f"{'kind':12s} {'ops':>3s} {'fwd us':>8s} {'bwd us':>8s} {'share':>6s}")
    for kind, (n, f, b) in sorted(shares.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"{kind:12s} {n:3d} {f * 1e6:8.1f} {b * 1e6:8.1f} {(f + b) / (fwd + bwd):6.1%}")


def _print_breakdown(run: Run) -> None:
    graph = build_graph(run)
    got = breakdown(graph, build_plan(run, graph), row_topology(run), row_cost(run))
    parts = [(f"compute {k}", v) for k, v in sorted(got.compute.items(), key=lambda kv: -kv[1])]
    parts += [(f"exposed comm {k}", v) for k, v in got.exposed.items()] + [("idle (bubble, waits)", got.idle)]
    print(f"{run.name}: iteration {got.iteration:.3f} s, device {got.device}: " + ", ".join(
        f"{k} {v * 1e3:.0f} ms ({v / got.iteration:.1%})" for k, v in parts), flush=True)


def _gib(nbytes: float | None) -> str:
    return f"{'-':>5s}" if nbytes is None else f"{nbytes / GiB:5.1f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="append", help="only this sweep's rows (repeatable); sweeps: "
                    + ", ".join(dict.fromkeys(r.sweep for r in ROWS)))
    ap.add_argument("--row", action="append", help="only the row of this name (repeatable), e.g. 7.5B, '22B full'")
    ap.add_argument("--max-gpus", type=int, default=MAX_GPUS, help="rows of more devices are listed, not simulated")
    ap.add_argument("--attention", choices=ATTENTION_KERNELS, help="every row with this attention kernel")
    ap.add_argument("--chunks", type=int, help="every row with this many model chunks a device (1: 1F1B, "
                    "more: interleaved 1F1B; Narayanan et al. §5.1 say Table 1 ran interleaved, its launch script "
                    "gives 39B and 1T none)")
    ap.add_argument("--shares", action="store_true", help="print each row's per-layer time by op kind, not the table")
    ap.add_argument("--breakdown", action="store_true", help="print where device 0's predicted iteration goes "
                    "(compute by kind, exposed communication by link, idle), not the table")
    args = ap.parse_args(argv)
    rows = tuple(r for r in ROWS if (args.sweep is None or r.sweep in args.sweep)
                 and (args.row is None or r.name in args.row))
    if args.attention is not None:
        rows = tuple(replace(r, attention=args.attention) for r in rows)
    if args.chunks is not None:
        rows = tuple(replace(r, chunks=args.chunks) for r in rows)
    if args.shares:
        for run in rows:
            _print_shares(run)
        return
    if args.breakdown:
        for run in rows:
            if (why := reachable(run, args.max_gpus)) is None:
                _print_breakdown(run)
            else:
                print(f"{run.name}: {why}")
        return
    print(f"{'row':17s} {'GPUs':>5s} {'TP':>3s} {'PP':>3s} {'DP':>4s} {'B':>5s} {'M':>4s} {'rec':>4s} {'pub s':>7s} "
          f"{'pred s':>7s} {'pub TF':>6s} {'pred TF':>7s} {'error':>7s} {'waves':>5s} {'peak':>5s} {'act':>5s} {'coll':>5s} "
          f"{'paper':>5s} {'sim s':>6s}  source", flush=True)
    errors: dict[str, list[tuple[float, float, float]]] = {}
    cached: tuple[tuple, OpGraph] | None = None  # a sweep's rows share one model's graph
    for run in rows:
        pub_tf = f"{run.tflops:6.0f}" if run.tflops is not None else f"{'-':>6s}"
        head = (f"{run.name:17s} {run.gpus:5d} {run.tp:3d} {run.pp:3d} {run.dp:4d} {run.batch:5d} "
                f"{run.microbatches:4d} {run.recompute[:4]:>4s} {published_seconds(run):7.2f}")
        if (why := reachable(run, args.max_gpus)) is not None:
            print(f"{head} {'-':>7s} {pub_tf} {'-':>7s} {'-':>7s} {block_wave_efficiency(run):5.3f} {'-':>5s} {'-':>5s} {'-':>5s} "
                  f"{_gib(korthikanti_activations(run))} {'-':>6s}  {run.source}; {why}", flush=True)
            continue
        t0 = time.perf_counter()
        shape = (run.model, run.layers, run.heads, run.kv_heads, run.hidden, run.ffn, run.seq, run.vocab, run.batch)
        if cached is None or cached[0] != shape:
            cached = (shape, build_graph(run))
        result = predict(run, cached[1], summary=True)
        err = throughput_error(run, result)
        # ranked by TFLOP/s per GPU or MFU where the source prints them (rows of several models),
        # else by iterations per second (rows of one model)
        ranked = (predicted_tflops(run, result), run.tflops) if run.tflops is not None else \
            (predicted_mfu(run, result), run.mfu) if run.wps is not None else \
            (1 / result.iteration_time, 1 / published_seconds(run))
        errors.setdefault(run.sweep, []).append((err, *ranked))
        notes = "; ".join(n for n in (f"interleaved 1F1B, {run.chunks} chunks" if run.chunks > 1 else "",
                                      "" if result.fits else "does not fit") if n)
        pred_tf = f"{predicted_tflops(run, result):7.1f}" if run.tflops is not None else f"{'-':>7s}"
        worst = max(range(len(result.peak_memory_bytes)), key=result.peak_memory_bytes.__getitem__)
        print(f"{head} {result.iteration_time:7.2f} {pub_tf} {pred_tf} {err:+7.1%} {block_wave_efficiency(run):5.3f} "
              f"{result.peak_memory_bytes[worst] / GiB:5.1f} {result.memory[worst].activations / GiB:5.1f} "
              f"{result.memory[worst].collective_buffers / GiB:5.1f} "
              f"{_gib(korthikanti_activations(run))} {time.perf_counter() - t0:6.1f}  "
              f"{run.source}{'; ' + notes if notes else ''}", flush=True)
    every = [abs(e) for sweep in errors.values() for e, _, _ in sweep]
    if every:
        print(f"|error| over {len(every)} rows: median {statistics.median(every):.1%}, max {max(every):.1%}")
    for sweep, found in errors.items():
        rho = spearman([p for _, p, _ in found], [m for _, _, m in found]) if len(found) > 1 else float("nan")
        print(f"Spearman rho, {sweep} ({len(found)} rows): {rho:.2f}")


if __name__ == "__main__":
    main()
