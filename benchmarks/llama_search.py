"""llama_search.py: the LLaMA-3 8B shape (zoo ``llama``, built on meta: 32 layers of 4096,
sequence 8192) at global batch 16, bf16 mixed precision, Adam, analytical costs (issue 22,
"Measure"): the plan a search finds in a short budget against FSDP (every weighted op at
ZeRO-3 over data parallel, data × tensor where the batch does not divide by the devices),
Megatron-LM (the default tensor-parallel degree, with and without full recompute) and the plan
a longer search finds, with the wall time to each plan.

The searches start from the factorization sweep (``init="swept"``, ``sweep.py``: the data ×
tensor × pipeline factorizations ordered by a closed-form estimate, the memory checked before
timing, timed best-first in at most half the budget, until no plan left can beat the best by its
bound; the chains start from its best two) and use the
scale moves: the repeated-block move (``repeat_move``: the 32 layers searched as one) and the
global move (``global_move``). Columns: ms per iteration, whether the plan fits in the
device's memory (``*``: it does not), seconds to the plan; "found / X" is the found plan's ms
over X's (< 1: found is faster); rows "(search's)" are the baselines the search scored first
(inside its wall time). The issue's goal: the short search within 2 % of the long
search's plan in ≤ 150 s wall.

``--restage`` prints, instead of the searches, what one restage (the global move's proposal
that rebalances a pipelined plan's stages, ``stagemove.restage`` on ``stagemove.op_seconds``)
costs and gives on three pipelined factorizations: each plan scored, restaged, the restaged
plan scored, as a chain does.

``--model gpt3-175b`` runs GPT-3 175B's shape (zoo ``gpt`` variant ``gpt3-175b`` on Megatron-LM's
padded vocabulary, 51,200 rows, ``_paper.megatron_vocab``; one sequence per device unless
``--batch``) against the plan Megatron-LM ran (``strategies.baselines.megatron_lm``,
Narayanan et al. SC'21: T = 8, P = 16, one sequence a micro-batch, 1F1B, sequence parallelism,
every layer recomputed, ZeRO-1, bf16); the search scores that family itself as its
``megatron_lm`` baseline (at the tensor × pipeline degrees its sweep's estimate picks, row
"megatron_lm (search's)") and among the sweep's factorizations; ``--long 0`` leaves the long
search out.

    python benchmarks/llama_search.py [--topology h100-8x8] [--budget 150] [--long 900]
    python benchmarks/llama_search.py --restage
    python benchmarks/llama_search.py --model gpt3-175b --topology a100-128x8 --budget 600 --long 0
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _paper

from _paper import GPT2_VOCAB, megatron_vocab  # noqa: E402
from simulator import heap, taskcache
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from soapsearch import trace, zoo
from soapsearch.search import search
from soapsearch.search import api
from soapsearch.search.api import Evaluator
from soapsearch.search.globalmove import Factorization, GlobalMoves
from soapsearch.search.stagemove import restage
from strategies import PlanError, baseline, zero, zero_alike
from strategies.baselines import hybrid, megatron_lm, recomputed, sharded
from strategies.lowering_bytes import LOWERING_BYTES

PRECISION, OPTIMIZER, BATCH = "bf16", "adam", 16
TP_175B, PP_175B = 8, 16
"""The tensor and pipeline degrees Megatron-LM ran GPT-3 175B at (Narayanan et al. SC'21); the
vocabulary is padded for that tensor degree."""


def _experts(model: str, graph, n: int) -> dict:
    if model == "gpt3-175b":  # Megatron-LM's own 175B run
        return {f"megatron T{TP_175B} P{PP_175B}":
                lambda: megatron_lm(graph, n, TP_175B, PP_175B, precision=PRECISION)}
    return {"fsdp": lambda: sharded(hybrid(graph, n), graph, 3),
            "megatron": lambda: baseline("megatron", graph, n),
            "megatron+recompute": lambda: recomputed(baseline("megatron", graph, n), graph)}


RESTAGED = (Factorization(8, 4, 4, "1f1b", 1, False, True), Factorization(4, 8, 8, "1f1b", 0, False, True),
            Factorization(8, 8, 1, "gpipe", 0, False, True))
"""tp × pp, micro-batches, schedule, ZeRO level, recompute, sequence parallel: ``--restage``'s plans."""


def _restage_table(graph, evaluate: Evaluator, n: int) -> None:
    """One restage per ``RESTAGED`` plan: the plan's ms, the restage's seconds, the restaged plan's ms."""
    moves = GlobalMoves(graph, n, (1, 2, 4, 8), PRECISION, evaluate)
    print("| plan | ms | restage s | restaged ms | restaged / plan |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for f in RESTAGED:
        plan = moves.plan(f)
        ms = evaluate(plan).iteration_ms
        t = time.perf_counter()
        new = restage(graph, plan, moves.op_seconds)
        took = time.perf_counter() - t
        new_ms = evaluate(new).iteration_ms if new is not None else ms
        print(f"| tp {f.tp} x pp {f.pp}, {f.microbatches} micro-batches, {f.schedule}, ZeRO-{f.zero} | {ms:.1f} | "
              f"{took:.2f} | {new_ms:.1f} | {new_ms / ms:.3f} |", flush=True)


_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.CodeType)
"""What ``_reachable`` neither counts nor follows: classes, functions and modules (a function's
globals are its module's, not a cache's)."""


def _reachable(root, skip: set[int]) -> int:
    """``sys.getsizeof`` of every object reachable from ``root`` (``gc.get_referents``) not in
    ``skip``, each once; the ids counted join ``skip``. Classes, functions and modules are
    passed over (``_CODE``); of a bound method (a block's ``Columns.add``) only the object it is
    bound to is followed."""
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in skip or isinstance(obj, _CODE):
            continue
        skip.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend((obj.__self__,) if isinstance(obj, types.MethodType) else gc.get_referents(obj))
    return total


def _cache_table(graph, evaluate: Evaluator) -> None:
    """Each cache of the search's Evaluator: its reachable MiB (the graph's objects, and each
    cache's from the ones above it, not counted again: the task blocks hold the lowering's
    pieces and the cost model too), and the lowering cache's own count. The ids kept add to the
    process's peak RSS."""
    skip: set[int] = set()
    _reachable(graph, skip)
    cost = evaluate.cost
    rows = [("lowering cache", evaluate.lowering_cache),
            ("cost model memos", (cost._by_box, cost._by_partition, cost._by_shape, cost._nodes, cost._ops)),
            ("`_seen` results", evaluate._seen), ("TaskCache", evaluate._tasks),
            ("`zero._KEPT`", zero._KEPT), ("`zero_alike._KEPT`", zero_alike._KEPT)]
    print("| cache | reachable MiB |")
    print("| --- | ---: |")
    for name, obj in rows:
        print(f"| {name} | {_reachable(obj, skip) / 2**20:.1f} |")
    print(f"lowering cache's count (pieces_bytes, held_bytes): {evaluate.lowering_cache.total() / 2**20:.1f} MiB, "
          f"bound {LOWERING_BYTES / 2**20:.0f} MiB a cache")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("llama", "gpt3-175b"), default="llama")
    ap.add_argument("--topology", default="h100-8x8")
    ap.add_argument("--batch", type=int, default=None, help="global batch (llama 16, gpt3-175b one per device)")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of the short search")
    ap.add_argument("--long", type=float, default=900.0, help="seconds of the long search (0: none)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--restage", action="store_true", help="one restage of three pipelined plans, no search")
    ap.add_argument("--caches", action="store_true", help="each cache's bytes after the short search")
    ap.add_argument("--cache-mib", type=int, default=None,
                    help="the task cache's bound (simulator.taskcache.CACHE_BYTES) in MiB, to compare policies")
    args = ap.parse_args()
    if args.cache_mib is not None:
        taskcache.CACHE_BYTES = args.cache_mib << 20
    topo = get_topology(args.topology)
    n = topo.num_devices
    batch = args.batch or (BATCH if args.model == "llama" else n)
    t0 = time.perf_counter()
    graph = trace(*(zoo.build("llama", "default", batch_size=batch, device="meta") if args.model == "llama"
                    else zoo.build("gpt", "gpt3-175b", batch_size=batch, device="meta",
                                   vocab_size=megatron_vocab(GPT2_VOCAB, TP_175B))))
    traced_s = time.perf_counter() - t0
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"), OPTIMIZER, PRECISION)
    if args.restage:
        return _restage_table(graph, evaluate, n)
    rows = []
    experts = _experts(args.model, graph, n)
    for name, make in experts.items():
        t = time.perf_counter()
        try:
            plan = evaluate.planned(make())
        except PlanError as e:
            print(f"{name}: {e}")
            continue
        res = evaluate(plan)
        rows.append((name, res.iteration_ms, res.fits, time.perf_counter() - t))
    evaluate = plan = res = None  # the experts' lowerings: the search lowers into a cache of its own
    found, searched = {}, []
    if args.caches:  # the short search's Evaluator, kept to read its caches after the run
        class Kept(Evaluator):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                searched.append(self)
        api.Evaluator = Kept
    for label, budget in (("search", args.budget), ("long search", args.long)):
        if not budget:
            continue
        t, cpu = time.perf_counter(), time.process_time()
        r = search(graph, topology=topo, budget_s=budget, optimizer=OPTIMIZER, precision=PRECISION,
                   init=("swept", "swept"), chains=2, workers=args.workers, seed=0)
        cpu = time.process_time() - cpu
        print(f"{label}: {r.proposals} proposals ({r.scored} scored) in {cpu:.1f} CPU s of this process "
              f"({r.proposals / cpu:.3f} a CPU s), task cache bound {taskcache.CACHE_BYTES >> 20} MiB", flush=True)
        found[label] = r
        rows.append((label, r.predicted_ms, r.result.fits, time.perf_counter() - t))
    print(f"{'LLaMA-3 8B shape' if args.model == 'llama' else 'GPT-3 175B shape'}, batch {batch}, {PRECISION}, "
          f"{OPTIMIZER}, {topo.name} ({n} devices); "
          f"traced in {traced_s:.1f} s")
    print("| plan | ms | fits | wall s | found / plan |")
    print("| --- | ---: | :---: | ---: | ---: |")
    best = found["search"].predicted_ms
    shown = {row[0] for row in rows}
    short = found["search"]
    rows[len(experts):len(experts)] = [  # the search's own baselines (simulated inside its wall time)
        (f"{name} (search's)", ms, short.baseline_results[name].fits, 0.0) for name, ms in short.baselines.items()
        if name not in shown]
    for name, ms, fits, wall in rows:
        print(f"| {name} | {ms:.1f}{'' if fits else ' *'} | {'yes' if fits else 'no'} | {wall:.1f} | "
              f"{best / ms:.3f} |")
    for label, r in found.items():
        s = r.strategy
        print(f"{label}: {r.proposals} proposals ({r.scored} scored), micro-batches {s.microbatches} {s.schedule}"
              f"{'' if s.overlap_grad_reduce else ', gradients synced after the backward'}, "
              f"{sum(1 for op in s if s[op].zero)} ops sharded, {sum(1 for op in s if s[op].recompute)} recomputed, "
              f"devices used {len(s.devices_used)}, best found at {r.history[-1][0] if r.history else 0.0:.1f} s, "
              f"baselines unscored: {', '.join(r.unscored) or 'none'}")
    if searched:
        _cache_table(graph, searched[0])
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (this process; "
          f"workers' apart); {heap.TRIMS.calls} heap trims in {heap.TRIMS.cpu_s:.2f} CPU s")


if __name__ == "__main__":
    main()
