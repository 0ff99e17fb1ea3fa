"""Receives posted a micro-batch ahead against receives posted when a step needs them.

    python benchmarks/receives_ahead.py [--nproc 2] [--models mlp,gpt,rnntc] [--steps 20]

The executor posts every receive of micro-batches j and j + 1 at its first step of j
(``soapsearch.executor.recipe.receives_ahead``). The baseline is the same executor with those
posts removed, so each receive is posted by the step that reads it (on demand): gloo then moves
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gloo import spawn_gloo  # noqa: E402

def _plans(graph, n: int) -> dict:
    """simulator_accuracy's plans that move point-to-point pieces."""
    from simulator_accuracy import plan_makers

    return {name: make() for name, make in plan_makers(graph, n).items() if name != "data_parallel"}


def _body(rank: int, world: int, args) -> list[tuple]:
    from soapsearch.calibrate.timing import median_slowest, step_times
    from soapsearch.executor import Executor, TrainConfig, build_model

    models, steps, warmup = args
    rows = []
    for model in models:
        built = build_model(model, "tiny", seed=0)
        runs = []
        for name, plan in _plans(built.graph, world).items():
            for ahead in (False, True):
                ex = Executor(built.graph, plan, built.state, built.inputs, TrainConfig(), "cpu")
                if not ahead:
                    ex.ahead = [()] * len(ex.steps)  # every receive posted by the step that reads it
                runs.append((name, ahead, ex, []))
        for k in range(warmup + steps):  # the variants take turns step by step
            for _, _, ex, times in runs:
                t = step_times(lambda: ex.step(seed=k), 1)  # noqa: B023 - called at once
                if k >= warmup:
                    times += t
        rows += [(model, name, ahead, median_slowest(times) * 1e3) for name, ahead, _, times in runs]
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
