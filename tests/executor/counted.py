"""One executor step of each named plan on a gloo rank with one function wrapped to log its
calls: the count tests' shared body (``test_gather_count``, ``test_collective_count``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from soapsearch.executor import Executor, TrainConfig, build_model
from tests.executor.gloo import gloo_group
from tests.executor.plans import make_plan


def save_counted_steps(rank: int, world: int, port: int, out: str, plans: tuple[str, ...], owner: object,
                       attr: str, entry: Callable) -> None:
    """Step gpt tiny (float64) once per plan with ``owner.attr`` wrapped: each call appends
    ``entry(*args, **kwargs)`` to that plan's log before calling through; saves {plan: log} to
    ``out/<rank>.pt``."""
    with gloo_group(rank, world, port):
        built = build_model("gpt", "tiny", dtype="float64")
        got = {}
        real = getattr(owner, attr)
        for name in plans:
            ex = Executor(built.graph, make_plan(built.graph, name, world), built.state, built.inputs,
                          TrainConfig("sgd", lr=0.01, timeout_s=60))
            log: list = []

            def counted(*args, log=log, **kwargs):
                log.append(entry(*args, **kwargs))
                return real(*args, **kwargs)
            setattr(owner, attr, counted)
            try:
                ex.step()
            finally:
                setattr(owner, attr, real)
            got[name] = log
        torch.save(got, Path(out) / f"{rank}.pt")
