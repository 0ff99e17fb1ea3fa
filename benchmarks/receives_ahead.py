"""Receives posted a micro-batch ahead against receives posted when a step needs them.

    python benchmarks/receives_ahead.py [--nproc 2] [--models mlp,gpt,rnntc] [--steps 20]

The executor posts every receive of micro-batches j and j + 1 at its first step of j
(``soapsearch.executor.recipe.receives_ahead``). The baseline is the same executor with those
posts removed, so each receive is posted by the step that reads it (as before): gloo then moves
a piece only once its receiver asks the sender for it, a round trip that waits for the sender's
process to get a core. Plans with point-to-point pieces (model parallel, OWT, GPipe and 1F1B
with 2 micro-batches, every linear cut on its output features) of tiny zoo models, on N gloo
processes; both variants take turns step by step in one launch, so load from elsewhere falls on
both alike. Prints the median step (slowest rank) of each and the ratio ahead / on demand.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gloo import spawn_gloo  # noqa: E402

PLANS = ("model_parallel", "owt", "pipeline_gpipe_m2", "pipeline_1f1b_m2", "param_split")


def _plans(graph, n: int) -> dict:
    from simulator_accuracy import param_split
    from strategies import baseline

    makers = {
        "model_parallel": lambda: baseline("model_parallel", graph, n),
        "owt": lambda: baseline("owt", graph, n),
        "pipeline_gpipe_m2": lambda: baseline("pipeline", graph, n, microbatches=2),
        "pipeline_1f1b_m2": lambda: baseline("pipeline", graph, n, microbatches=2).with_microbatches(2, "1f1b"),
        "param_split": lambda: param_split(graph, n),
    }
    return {name: makers[name]() for name in PLANS}


def _body(rank: int, world: int, args) -> list[tuple]:
    import torch
    import torch.distributed as dist

    from soapsearch.executor import Executor, TrainConfig, build_model

    models, steps, warmup = args
    rows = []
    for model in models:
        built = build_model(model, "tiny", seed=0)
        runs = []
        for name, plan in _plans(built.graph, world).items():
            for ahead in (False, True):
                ex = Executor(built.graph, plan, built.model.state_dict(), built.inputs, TrainConfig(), "cpu")
                if not ahead:
                    ex.ahead = [()] * len(ex.steps)  # every receive posted by the step that reads it
                runs.append((name, ahead, ex, []))
        for k in range(warmup + steps):
            for _, _, ex, times in runs:
                dist.barrier()
                t0 = time.perf_counter()
                ex.step(seed=k)
                if k >= warmup:
                    times.append(time.perf_counter() - t0)
        for name, ahead, _, times in runs:
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append((model, name, ahead, statistics.median(slowest.tolist()) * 1e3))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--models", default="mlp,gpt,rnntc")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    rows = spawn_gloo(_body, (args.models.split(","), args.steps, args.warmup), world=args.nproc)
    ms = {(m, name, ahead): t for m, name, ahead, t in rows}
    print(f"{args.nproc} gloo processes, median of {args.steps} steps (slowest rank)\n")
    print("model | plan | on demand ms | ahead ms | ahead / on demand")
    print("--- | --- | ---: | ---: | ---:")
    ratios = []
    for m, name in dict.fromkeys((m, name) for m, name, _, _ in rows):
        before, after = ms[(m, name, False)], ms[(m, name, True)]
        ratios.append(after / before)
        print(f"{m} | {name} | {before:.2f} | {after:.2f} | {after / before:.2f}")
    print(f"\nmedian ratio {statistics.median(ratios):.2f} over {len(ratios)} plans "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
