"""Measure the executor's host overheads on N processes (run inside ``measure``'s spawn, so
processes sharing cores are measured sharing them); ``fit.fit_overheads`` turns the raw times
into ``task_overhead``, ``collective_overhead``, ``message_overhead`` and ``exchange_overhead``.

The probe is a chain ``(linear -> tanh) x K -> cross-entropy`` on a tiny batch (every op a few
µs of arithmetic, so what the framework and the executor add stands out; a linear, with its
weight gradient, and an elementwise op, as most models are made of), trained by the real
``Executor`` under three plans:

* ``data_parallel``, K in ``TASK_SIZES``: every op cut N ways on the batch, all processes busy
  at once, 4 tasks (forward, backward of the linear and the tanh) per unit on every device.
  Long chains: the step's collective (the gradient bucket, the loss's sum riding it), a
  wake-up on cores shared with other work, scatters it by milliseconds, so the slope in K needs
  hundreds of tasks to stand clear of it; the intercept, against the simulator's for the same
  chains, gives the collective overhead;
* ``pipeline``, m in ``PIPELINE_MICROBATCHES`` (N >= 2): a chain of ``PIPELINE_UNITS`` units
  in N stages (``strategies.baselines.pipeline``, GPipe) fed m micro-batches: the pieces
  crossing each stage boundary, one per micro-batch each way, are one-way pieces between a
  computing sender and a waiting receiver, as in any pipeline or model-parallel plan;
* ``exchange``, K in ``PIECE_SIZES`` (N >= 2): every linear cut N ways on its output features,
  every other op on the batch on the devices in reverse order (so no read is an all-gather:
  ``strategies.collectives``; OWT cuts the tanh after a linear on features too): each unit's linear reads the whole
  batch and its tanh all of its rows' features, so every device receives 2(N - 1) pieces per
  unit forward and as many gradients back, each op sending pieces both ways while every device
  computes. Pieces between busy processes cost more than one-way pieces (the sender's
  ``isend`` and the receiver's wake-up compete with the other process's compute for the cores);
  the simulator charges them ``exchange_overhead``.

Each round measures all of these once (the median over ``steps`` steps of the slowest rank,
as ``compare.run_plans`` times a plan);
``measure`` spreads the rounds over the calibration, between its ping-pong rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from simulator.comm import allreduce_time
from simulator.cost import CostModel
from simulator.simulate import simulate_plan
from simulator.step import COPY_TRAFFIC, UPDATE_TRAFFIC
from simulator.topology import Topology
from soapsearch.calibrate.timing import median_slowest, step_times
from strategies import ParallelConfig, baseline
from strategies.graph import OpGraph
from strategies.lowering import lower

__all__ = ["PIECE_SIZES", "PIPELINE_MICROBATCHES", "PIPELINE_UNITS", "TASK_SIZES", "Chain", "OverheadProbe",
           "build_chain", "probe_chains", "probe_simulator", "unit_kernel_seconds"]

TASK_SIZES = (8, 64, 128)
"""K (linear + tanh units) of the data-parallel chains: the task overhead is a slope over them."""
PIECE_SIZES = (2, 8, 16)
"""K of the exchange chains: the exchange overhead is a slope over them."""
PIPELINE_UNITS, PIPELINE_MICROBATCHES = 8, (1, 4, 8)
"""K of the pipeline chain, and its micro-batch counts: the message overhead is fitted to its
mean step over them (its batch: 8·N rows)."""
ROWS_PER_DEVICE, WIDTH = 4, 16
"""The probe's batch slice per device and its width (an exchange piece: 4 rows × 16 / N
features, or 4·N rows × 16 / N, float32)."""


class Chain(nn.Module):
    """``cross_entropy((tanh ∘ linear)^K(x), y)``."""

    def __init__(self, width: int, k: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(k))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(x, y)


def build_chain(k: int, batch: int, seed: int = 0) -> tuple[Chain, tuple[torch.Tensor, torch.Tensor], OpGraph]:
    """The probe model with K linear + tanh units, its batch and its traced OpGraph (same seed:
    same on every rank)."""
    from soapsearch.trace import trace

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Chain(WIDTH, k)
    x = torch.randn(batch, WIDTH, generator=gen)
    y = torch.randint(0, WIDTH, (batch,), generator=gen)
    return model, (x, y), trace(model, (x, y), name=f"calibrate-chain-{k}")


def probe_chains(n: int, task_sizes: Sequence[int] = TASK_SIZES, piece_sizes: Sequence[int] = PIECE_SIZES,
                 microbatches: Sequence[int] = PIPELINE_MICROBATCHES):
    """(plan name, model, batch, graph, plan) of every chain of the probe on ``n`` devices (see
    the module docstring), per name in the order of its sizes: ``data_parallel`` over
    ``task_sizes``, and for n >= 2 ``exchange`` over ``piece_sizes`` (data parallel with every
    linear cut on out_features) and ``pipeline`` over ``microbatches`` (n GPipe stages of
    ``PIPELINE_UNITS`` units, 8·n rows). The probe runs them, ``probe_simulator`` simulates
    them, and the fit pairs the two by this order."""
    everyone = tuple(range(n))
    for k in task_sizes:
        model, batch, graph = build_chain(k, ROWS_PER_DEVICE * n)
        yield "data_parallel", model, batch, graph, baseline("data_parallel", graph, n)
    if n < 2:
        return
    for k in piece_sizes:
        model, batch, graph = build_chain(k, ROWS_PER_DEVICE * n)
        plan = baseline("data_parallel", graph, n)
        for node in graph:
            if node.kind == "linear":
                plan = plan.replace(node.name, ParallelConfig(
                    tuple(n if i == len(node.output.shape) - 1 else 1 for i in range(len(node.dims))), everyone))
            elif plan[node.name].devices == everyone:
                # batch slices on the devices in reverse order: no linear's read of them is an
                # all-gather in its group's order (``strategies.collectives``), so every read
                # stays point-to-point pieces, which this chain measures
                plan = plan.replace(node.name, ParallelConfig(plan[node.name].degrees, everyone[::-1]))
        yield "exchange", model, batch, graph, plan
    model, batch, graph = build_chain(PIPELINE_UNITS, 8 * n)
    for m in microbatches:
        yield "pipeline", model, batch, graph, baseline("pipeline", graph, n, microbatches=m)


def unit_kernel_seconds(topology: Topology, cost: CostModel, optimizer: str = "sgd") -> float:
    """Seconds the simulator charges one linear + tanh unit of the data-parallel probe on
    ``topology``'s device 0 beyond task overheads (what ``fit.fit_overheads`` takes off the
    measured slope in K): forward + backward of its 2 partitions (``cost``), the update and
    bucket copy traffic of its trainable bytes u (``(UPDATE_TRAFFIC + 2·COPY_TRAFFIC) · u /
    memory_bandwidth``: the update, the bucket packed and copied back, with N > 1) and its share of the
    gradient bucket's ring all-reduce (``allreduce_time(2u) - allreduce_time(u)`` = 2(n-1)/n ·
    u / B: the latency terms cancel)."""
    nproc, device = topology.num_devices, topology.devices[0]
    _, _, graph = build_chain(1, ROWS_PER_DEVICE * nproc)
    low = lower(graph, baseline("data_parallel", graph, nproc))
    unit = [n for n in graph if n.kind in ("linear", "elementwise")]
    kernels = sum(sum(cost.op_time(n, low.partitions[n.name][0][0].box, device)) for n in unit)
    u = sum(s.nbytes for s in low.weight_shards if s.trainable and 0 in s.devices)
    everyone = tuple(range(nproc))
    bucket = allreduce_time(topology, everyone, 2 * u) - allreduce_time(topology, everyone, u)
    copies = 2 * COPY_TRAFFIC if nproc > 1 else 0  # one process holds no bucket to pack
    return kernels + (UPDATE_TRAFFIC[optimizer] + copies) * u / device.memory_bandwidth + bucket


def probe_simulator(make_topology: Callable[[Mapping[str, float]], Topology], cost: CostModel,
                    task_sizes: Sequence[int] = TASK_SIZES, piece_sizes: Sequence[int] = PIECE_SIZES,
                    microbatches: Sequence[int] = PIPELINE_MICROBATCHES) -> Callable[[str, Mapping[str, float]], list[float]]:
    """``fit.ProbeSimulator`` of the probe: (plan, overheads) -> simulated step seconds of that
    plan's chains (``task_sizes`` for data parallel, ``piece_sizes`` for the exchange,
    ``microbatches`` for the pipeline), on ``make_topology(overheads)`` (overheads by
    ``DeviceSpec`` field name, absent: 0; the chains are lowered once)."""
    lowered: dict[str, list] = {}
    for name, _, _, graph, plan in probe_chains(make_topology({}).num_devices, task_sizes, piece_sizes, microbatches):
        lowered.setdefault(name, []).append((graph, lower(graph, plan)))

    def simulate(plan: str, overheads: Mapping[str, float]) -> list[float]:
        topo = make_topology(overheads)
        return [simulate_plan(g, low, topo, cost, summary=False).iteration_ms / 1e3 for g, low in lowered[plan]]

    return simulate


class OverheadProbe:
    """The probe chains built on this rank (the default group initialized) and warmed up;
    each ``round()`` measures every figure once (see the module docstring). ``result(rounds)``
    is what ``fit_overheads`` reads: {"task_sizes", "piece_sizes", "microbatches", "rounds":
    [{"data_parallel": [s per task size], "exchange": [s per piece size], "pipeline": [s per
    micro-batch count]}]} (one process: data parallel only)."""

    def __init__(self, world: int, task_sizes: Sequence[int] = TASK_SIZES,
                 piece_sizes: Sequence[int] = PIECE_SIZES, microbatches: Sequence[int] = PIPELINE_MICROBATCHES,
                 steps: int = 3, warmup: int = 2):
        from soapsearch.executor import Executor, TrainConfig

        self.task_sizes, self.piece_sizes, self.microbatches = list(task_sizes), list(piece_sizes), list(microbatches)
        self.steps = steps
        self.runs: dict[str, list[Callable[[], Any]]] = {}
        for name, model, batch, graph, plan in probe_chains(world, task_sizes, piece_sizes, microbatches):
            ex = Executor(graph, plan, model.state_dict(), batch, TrainConfig(), "cpu")
            self.runs.setdefault(name, []).append(ex.step)
        for fns in self.runs.values():
            for fn in fns:
                for _ in range(warmup):
                    fn()

    def round(self) -> dict[str, list[float]]:
        return {name: [median_slowest(step_times(fn, self.steps)) for fn in fns] for name, fns in self.runs.items()}

    def result(self, rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"task_sizes": self.task_sizes, "piece_sizes": self.piece_sizes, "microbatches": self.microbatches,
                "rounds": list(rounds)}
