"""Measure the executor's host overheads on N processes (run inside ``measure``'s spawn, so
processes sharing cores are measured sharing them); ``fit.fit_overheads`` turns the raw times
into ``task_overhead`` and ``message_overhead``.

The probe is a chain ``linear -> tanh x K -> cross-entropy`` on a tiny batch (every op a few µs
of kernel, so what the executor adds stands out), trained by the real ``Executor`` under three
plans, for several K:

* ``data_parallel``: every op cut N ways on the batch, all processes busy at once; each device
  runs 2 tasks (forward, backward) per tanh, with no transfer between them;
* ``one_device``: every op whole on device 0 (the control of the next);
* ``round_robin``: the chain's ops whole, op i on device i mod N (N >= 2): every tanh reads its
  input from another device and sends its gradient back, two point-to-point pieces per op on
  the critical path (the inputs sit with their consumers, so they move nothing).

Beside them, the eager forward + backward of the same chain on one device's batch slice (all
processes at once): the kernels the cost model charges. Each round times every (plan, K) once
(median of ``steps`` steps, slowest rank), so a burst of load from elsewhere falls on one
round's every point alike and the per-round slopes stay clean; ``measure`` spreads the rounds
over the calibration, between its ping-pong rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from strategies import ParallelConfig, Strategy, baseline
from strategies.graph import OpGraph
from strategies.lowering import lower

__all__ = ["CHAIN_SIZES", "PLANS", "Chain", "OverheadProbe", "chain_plans", "measure_overheads"]

CHAIN_SIZES = (4, 16, 32)
"""The K (tanh ops) of the probe chains: the fit is a slope over them."""
PLANS = ("data_parallel", "one_device", "round_robin")
ROWS_PER_DEVICE, WIDTH = 4, 16
"""The probe's batch slice per device and its width: a round-robin piece is the whole batch's
activation, 4·N·16 float32 (512 bytes on 2 processes)."""


class Chain(nn.Module):
    """``cross_entropy(tanh^K(linear(x)), y)``: one trainable weight, so every op needs a gradient."""

    def __init__(self, width: int, k: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.k = k

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(self.k):
            h = torch.tanh(h)
        return F.cross_entropy(h, y)


def build_chain(k: int, batch: int, seed: int = 0) -> tuple[Chain, tuple[torch.Tensor, torch.Tensor], OpGraph]:
    """The probe model with K tanh ops, its batch and its traced OpGraph (same seed: same on
    every rank)."""
    from soapsearch.trace import trace

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Chain(WIDTH, k)
    x = torch.randn(batch, WIDTH, generator=gen)
    y = torch.randint(0, WIDTH, (batch,), generator=gen)
    return model, (x, y), trace(model, (x, y), name=f"calibrate-chain-{k}")


def chain_plans(graph: OpGraph, n: int) -> dict[str, Strategy]:
    """The probe's plans on ``n`` devices (see the module docstring); ``round_robin`` only
    for n >= 2."""
    whole = {node.name: (1,) * len(node.dims) for node in graph}
    plans = {"data_parallel": baseline("data_parallel", graph, n),
             "one_device": Strategy.of({op: ParallelConfig(d, (0,)) for op, d in whole.items()}, n)}
    if n >= 2:
        device: dict[str, int] = {}
        for i, node in enumerate(x for x in graph if x.kind != "input"):
            device[node.name] = i % n
        for node in graph:
            if node.kind == "input":  # with its first consumer: inputs never move
                device[node.name] = device[next(c.name for c in graph if node.name in c.inputs)]
        plans["round_robin"] = Strategy.of({op: ParallelConfig(d, (device[op],)) for op, d in whole.items()}, n)
    return plans


def received_pieces(graph: OpGraph, plan: Strategy) -> tuple[int, int]:
    """(pieces received per step over all devices, bytes of each): every remote transfer of
    the chain moves its activation forward and its gradient back (no input is remote)."""
    remote = [t for t in lower(graph, plan).transfers if not t.local]
    if any(graph[t.src_op].kind == "input" for t in remote):
        raise AssertionError("calibrate probe: an input moves between devices; it must sit with its consumer")
    return 2 * len(remote), (remote[0].nbytes if remote else 0)


def _slowest_median(fn: Callable[[], Any], steps: int) -> float:
    """Median over ``steps`` runs of ``fn`` (each after a barrier) of the slowest rank's time."""
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


class OverheadProbe:
    """The probe chains built on this rank (the default group initialized) and warmed up;
    each ``round()`` times every (plan, K) and the eager chains once. ``result(rounds)`` is
    what ``fit_overheads`` reads: {"sizes", "pieces", "piece_bytes", "rounds": [{plan or
    "eager": [seconds per size]}]}."""

    def __init__(self, world: int, sizes: Sequence[int] = CHAIN_SIZES, steps: int = 3, warmup: int = 2):
        from soapsearch.executor import Executor, TrainConfig

        self.sizes, self.steps = list(sizes), steps
        self.runs: dict[str, list[Callable[[], Any]]] = {}
        self.pieces: list[int] = []
        self.piece_bytes = 0
        for k in sizes:
            model, batch, graph = build_chain(k, ROWS_PER_DEVICE * world)
            for name, plan in chain_plans(graph, world).items():
                ex = Executor(graph, plan, model.state_dict(), batch, TrainConfig(), "cpu")
                self.runs.setdefault(name, []).append(ex.step)
                if name == "round_robin":
                    count, self.piece_bytes = received_pieces(graph, plan)
                    self.pieces.append(count)
            eager_model, (x, y), _ = build_chain(k, ROWS_PER_DEVICE)

            def eager(m: Chain = eager_model, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                m.zero_grad(set_to_none=True)
                m(x, y).backward()
            self.runs.setdefault("eager", []).append(eager)
        for fns in self.runs.values():
            for fn in fns:
                for _ in range(warmup):
                    fn()

    def round(self) -> dict[str, list[float]]:
        return {name: [_slowest_median(fn, self.steps) for fn in fns] for name, fns in self.runs.items()}

    def result(self, rounds: Sequence[dict[str, list[float]]]) -> dict[str, Any]:
        return {"sizes": self.sizes, "pieces": self.pieces, "piece_bytes": self.piece_bytes,
                "rounds": list(rounds)}


def measure_overheads(rank: int, world: int, sizes: Sequence[int] = CHAIN_SIZES, rounds: int = 5,
                      steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    """``rounds`` rounds of an ``OverheadProbe`` in a row (``measure`` interleaves them with
    its ping-pong rounds instead); every rank returns the same times (the slowest rank's)."""
    probe = OverheadProbe(world, sizes, steps, warmup)
    return probe.result([probe.round() for _ in range(rounds)])
