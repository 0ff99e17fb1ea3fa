"""search_vs_experts.py --suite gpt: the found plan against the plans practitioners write for
transformers, on A100 nodes (one node, four nodes), analytical costs.

Models: zoo gpt (GPT-2 small, 12 sequences of 1024 per GPU as nanoGPT), GPT-3 1.3B and 6.7B's
shapes (zoo variants gpt3-1.3b / gpt3-6.7b, Brown et al. 2020 Table 2.1; 1 sequence of 2048 per
GPU, Megatron-LM's micro-batch of its GPT-3 scripts) and zoo llama (LLaMA-3 8B, 1 sequence of
8192 per GPU as torchtitan), all built on meta; batch = that per GPU × devices. Rows: data
parallel, Megatron-LM at T = 8 and at the best T of 2, 4, 8 (``strategies.megatron``, sequence
parallel, M = T micro-batches so that each data-parallel rank's micro-batch is the per-GPU batch,
accumulated as Megatron-LM's --micro-batch-size with a larger global batch does), the best
pipeline (GPipe or 1F1B over 2, 4, 8 micro-batches) and the plan ``search`` finds in the budget
from the best Megatron plan (fitting first) with its micro-batches, or from data parallel where
there is none (it scores every baseline first and is never worse). A plan that does not fit in
device memory (``simulator.memory``) is marked ``*``; "vs best" is found / the fastest baseline
that fits.
"""

from __future__ import annotations

import time

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.result import SimResult
from soapsearch.search import search
from soapsearch.search.api import Evaluator
from strategies import PlanError, data_parallel
from strategies.megatron import megatron
from _paper import paper_graph  # benchmarks/_paper.py

MODELS = ["gpt", "gpt3-1.3b", "gpt3-6.7b", "llama"]
TOPOLOGIES = ["a100-1x8", "a100-4x8"]
TP = (2, 4, 8)
BUDGET_S = 15.0
"""Search seconds per row: the eight rows run in about ten minutes on two cores."""


def _graph(model: str, num_devices: int):
    """The suite's model (a zoo name, or a gpt variant's name) on meta for ``num_devices``."""
    name, variant = ("gpt", model) if model.startswith("gpt3-") else (model, "default")
    return paper_graph(name, num_devices, variant)


def cell(r: SimResult | None) -> str:
    """Iteration ms, ``*`` when the plan does not fit."""
    return f"{'-':>10s}" if r is None else f"{r.iteration_ms:9.0f}{' ' if r.fits else '*'}"


def gib(r: SimResult) -> str:
    return f"{max(r.peak_memory_bytes) / 2**30:6.0f}"


def run(models: list[str], topologies: list[str], budget_s: float, seed: int, optimizer: str) -> None:
    print(f"optimizer {optimizer}; ms per iteration, * = does not fit in device memory", flush=True)
    print(f"{'model':10s} {'topology':9s} {'dev':>3s} {'batch':>5s} {'DP ms':>10s} {'MP T8 ms':>10s} "
          f"{'MP best':>10s} {'T':>2s} {'pipe ms':>10s} {'found ms':>10s} {'vs best':>7s} "
          f"{'MP8 GiB':>7s} {'found GiB':>9s} {'sim s':>6s} {'prop/s':>6s} {'search s':>8s}", flush=True)
    for topo_name in topologies:
        topo = get_topology(topo_name)
        n = topo.num_devices
        for model in models:
            graph = _graph(model, n)
            evaluate = Evaluator(graph, topo, get_cost_model("analytical"), optimizer)
            mp: dict[int, tuple] = {}
            t0 = time.perf_counter()
            heads = {n.shape[i] for n in graph if n.kind == "attention"
                     for i, d in enumerate(n.dims) if d.name == "heads"}
            for t in TP:
                if any(h % t for h in heads):  # Megatron-LM splits whole heads (zoo gpt: 12)
                    continue
                try:  # M = T micro-batches: each data-parallel rank's micro-batch is the per-GPU
                    # batch, accumulated M times (Megatron-LM's --micro-batch-size, global batch)
                    plan = megatron(graph, n, tp=t, microbatches=t, sequence_parallel=True)
                except PlanError:
                    continue
                mp[t] = (plan, evaluate(plan, summary=True))
            if not mp:
                t0 = time.perf_counter()
                evaluate(data_parallel(graph, n), summary=True)
            sim_s = (time.perf_counter() - t0) / max(len(mp), 1)  # a fresh plan, lowered and simulated
            # none where megatron_blocks finds no block (zoo llama: RoPE and SwiGLU between the linears)
            best_t = min(mp, key=lambda t: (not mp[t][1].fits, mp[t][1].iteration_time), default=None)
            # the chains run the best Megatron plan's micro-batches and start from it; without
            # one, from data parallel; search scores every baseline (pipeline too) first
            m = mp[best_t][0].microbatches if best_t else 1
            inits = (mp[best_t][0],) if best_t else ("data_parallel",)
            found = search(graph, topology=topo, budget_s=budget_s, init=inits, seed=seed,
                           optimizer=optimizer, microbatches=m, schedule="1f1b")
            b = found.baseline_results
            dp = b.get("data_parallel") or b.get("hybrid")
            rows = [dp, mp.get(8, (None, None))[1], mp.get(best_t, (None, None))[1], b.get("pipeline")]
            best = min((r.iteration_ms for r in rows if r is not None and r.fits),
                       default=min(r.iteration_ms for r in rows if r is not None))  # the fastest that fits
            print(f"{model:10s} {topo_name:9s} {n:3d} {graph.batch_size:5d} " + " ".join(cell(r) for r in rows[:3])
                  + f" {best_t or '-':>2} {cell(rows[3])} {cell(found.result)} {found.predicted_ms / best:6.3f}x"
                  f" {gib(rows[1]) if rows[1] else '-':>7s} {gib(found.result):>9s} {sim_s:6.2f}"
                  f" {found.proposals / budget_s:6.1f} {found.elapsed_s:8.1f}", flush=True)
