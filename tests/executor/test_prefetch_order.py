"""The executor runs ZeRO-3 prefetch as ``strategies.prefetch`` says (FSDP2's one unit ahead):
on each rank, every level-3 all-gather after the first is started before the previous
gathering step computes, and waited right before its own reader computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soapsearch.executor import Executor, TrainConfig, build_model
from strategies import data_parallel
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.executor.plans import zero

pytestmark = pytest.mark.distributed

WORLD = 2


def _record(rank: int, world: int, port: int, out: str) -> None:
    with gloo_group(rank, world, port):
        built = build_model("mlp", "tiny", dtype="float64")
        ex = Executor(built.graph, zero(3, data_parallel(built.graph, WORLD), built.graph), built.state,
                      built.inputs, TrainConfig("sgd", lr=0.01, timeout_s=60))
        log, fsdp = [], ex.weights.fsdp
        start, unshard, fwd, bwd = fsdp.start, fsdp.unshard, ex._forward, ex._backward

        def started(calls):  # per op (fsdp_unit "op"): one group a call
            log.extend(("start", u.op, len(fsdp.inflight) + i) for i, [u] in enumerate(calls) if u.zero == 3)
            start(calls)

        def waited(groups):
            log.extend(("wait", u.op, len(fsdp.inflight)) for u in groups if u.zero == 3)
            unshard(groups)
        fsdp.start, fsdp.unshard = started, waited
        ex._forward = lambda r: (log.append(("fwd", r.part.op, len(fsdp.inflight))), fwd(r))[1]
        ex._backward = lambda r: (log.append(("bwd", r.part.op, len(fsdp.inflight))), bwd(r))[1]
        ex.step()
        torch.save(log, Path(out) / f"{rank}.pt")


@pytest.mark.slow
def test_gather_k_plus_1_starts_before_reader_k_computes():
    """zoo mlp, data parallel on 2 ranks, level 3: three linears, so six gathering steps (their
    forwards, then their backwards in reverse). On each rank the log is: start 1, start 2,
    wait 1, compute 1 with gather 2 in flight, start 3, wait 2, compute 2 with 3 in flight, ...
    the last unit's gather waited with nothing started after it."""
    logs = spawn_ranks(_record, WORLD)
    for log in logs:
        units = [(kind, op) for kind, op, _ in log if kind in ("fwd", "bwd")]
        waits = [i for i, e in enumerate(log) if e[0] == "wait"]
        starts = [i for i, e in enumerate(log) if e[0] == "start"]
        assert len(waits) == len(starts) == 6
        gathering = [log[w + 1] for w in waits]  # each wait is right before its reader computes
        assert [(k, op) for k, op, _ in gathering] == [u for u in units if u[1] in ("layers_0", "layers_2", "layers_4")]
        assert [log[i][1] for i in starts] == [log[i][1] for i in waits]  # started in the order waited
        assert starts[0] < starts[1] < waits[0]  # the first unit issues its own and the next one's
        for k in range(1, 5):
            assert waits[k - 1] < starts[k + 1] < waits[k]  # unit k+1's issued at unit k's start
        assert [c for _, _, c in gathering] == [1, 1, 1, 1, 1, 0]  # the next unit's gather in flight
