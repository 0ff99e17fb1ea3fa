"""A gloo process group that runs many (model, plan) cases in one launch and saves what rank 0
gathers (losses, full gradients, full state_dicts) for the parent to compare."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

from soapsearch.executor import Executor, TrainConfig, build_model
from tests.executor.gloo import gloo_group
from tests.executor.plans import make_plan

STEPS = 2
OPTIMIZERS = {"sgd": TrainConfig("sgd", lr=0.05, momentum=0.9, timeout_s=60),
              "adam": TrainConfig("adam", lr=0.01, timeout_s=60)}


def run_cases(rank: int, world: int, port: int, cases: list[tuple], out_dir: str) -> None:
    with gloo_group(rank, world, port):
        for i, (model_name, plan, *batch) in enumerate(cases):
            try:
                built = build_model(model_name, "tiny", batch_size=(batch or [None])[0], dtype="float64")
                strategy = make_plan(built.graph, plan, world)
                result = {}
                for opt, cfg in OPTIMIZERS.items():
                    ex = Executor(built.graph, strategy, built.state, built.inputs, cfg)
                    losses, grads, states = [], [], []
                    for s in range(STEPS):
                        losses.append(ex.step(seed=s))
                        grads.append(ex.gradients())
                        states.append(ex.state_dict())
                    result[opt] = {"losses": losses, "grads": grads, "states": states}
                result["microbatches"] = strategy.microbatches
            except Exception:
                result = {"error": f"rank {rank}: {traceback.format_exc()}"}
                torch.save(result, Path(out_dir) / f"{i}.rank{rank}.pt")
                raise
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{i}.pt")
