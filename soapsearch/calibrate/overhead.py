"""Measure the executor's host overheads on N processes (run inside ``measure``'s spawn, so
processes sharing cores are measured sharing them); ``fit.fit_overheads`` turns the raw times
into ``task_overhead``, ``message_overhead`` and ``collective_overhead``.

The probe is a chain ``(linear -> tanh) x K -> cross-entropy`` on a tiny batch (every op a few
µs of arithmetic, so what the framework and the executor add stands out; a linear, with its
weight gradient, and an elementwise op, as most models are made of), trained by the real
``Executor`` under three plans:

* ``data_parallel``, K in ``TASK_SIZES``: every op cut N ways on the batch, all processes busy
  at once, 4 tasks (forward, backward of the linear and the tanh) per unit on every device.
  Long chains: the step's few collectives (the loss's reduction, the gradient sync), each a
  wake-up on cores shared with other work, scatter it by milliseconds, so the slope in K needs
  hundreds of tasks to stand clear of them; the intercept, against the simulator's for the same
  chains, gives the collective overhead;
* ``one_device``, K in ``PIECE_SIZES``: every op whole on device 0 (the control of the next);
* ``round_robin``, K in ``PIECE_SIZES`` (N >= 2): the chain's ops whole, op i on device i mod N:
  every op reads its input from another device and sends its gradient back, two
  point-to-point pieces per op on the critical path (the inputs sit with their consumers, so
  they move nothing).

Each round measures all of these once (the median over ``steps`` steps of the slowest rank,
as ``compare.run_plans`` times a plan);
``measure`` spreads the rounds over the calibration, between its ping-pong rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from simulator.comm import allreduce_time
from simulator.cost import CostModel
from simulator.simulate import simulate_plan
from simulator.step import UPDATE_TRAFFIC
from simulator.topology import Topology
from soapsearch.calibrate.timing import median_slowest, step_times
from strategies import ParallelConfig, Strategy, baseline
from strategies.graph import OpGraph
from strategies.lowering import lower

__all__ = ["PIECE_SIZES", "TASK_SIZES", "Chain", "OverheadProbe", "build_chain", "chain_plans",
           "probe_simulator", "received_pieces",
           "unit_kernel_seconds"]

TASK_SIZES = (8, 64, 128)
"""K (linear + tanh units) of the data-parallel chains: the task overhead is a slope over them."""
PIECE_SIZES = (1, 4, 8)
"""K of the one-device and round-robin chains: the message overhead is a slope over them."""
ROWS_PER_DEVICE, WIDTH = 4, 16
"""The probe's batch slice per device and its width: a round-robin piece is the whole batch's
activation, 4·N·16 float32 (512 bytes on 2 processes)."""


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


def unit_kernel_seconds(topology: Topology, cost: CostModel, optimizer: str = "sgd") -> float:
    """Seconds the simulator charges one linear + tanh unit of the data-parallel probe on
    ``topology``'s device 0 beyond task overheads (what ``fit.fit_overheads`` takes off the
    measured slope in K): forward + backward of its 2 partitions (``cost``), the update traffic
    of its trainable bytes u (``UPDATE_TRAFFIC · u / memory_bandwidth``) and its share of the
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
    return kernels + UPDATE_TRAFFIC[optimizer] * u / device.memory_bandwidth + bucket


def probe_simulator(make_topology: Callable[[float, float], Topology], cost: CostModel,
                    task_sizes: Sequence[int] = TASK_SIZES) -> Callable[[float, float], list[float]]:
    """``fit.ProbeSimulator`` of the data-parallel probe: (task_overhead, collective_overhead)
    -> simulated step seconds of the chain of each of ``task_sizes`` units, on
    ``make_topology(task_overhead, collective_overhead)`` (the chains are lowered once)."""
    nproc = make_topology(0.0, 0.0).num_devices
    lowered = []
    for k in task_sizes:
        _, _, graph = build_chain(k, ROWS_PER_DEVICE * nproc)
        lowered.append((graph, lower(graph, baseline("data_parallel", graph, nproc))))

    def simulate(task_overhead: float, collective_overhead: float) -> list[float]:
        topo = make_topology(task_overhead, collective_overhead)
        return [simulate_plan(g, low, topo, cost, summary=False).iteration_ms / 1e3 for g, low in lowered]

    return simulate


class OverheadProbe:
    """The probe chains built on this rank (the default group initialized) and warmed up;
    each ``round()`` measures every figure once (see the module docstring). ``result(rounds)``
    is what ``fit_overheads`` reads: {"task_sizes", "piece_sizes", "pieces", "piece_bytes",
    "rounds": [{"data_parallel": [s per task size], "one_device", "round_robin": [s per piece
    size]}]} (one process: no round robin, no pieces)."""

    def __init__(self, world: int, task_sizes: Sequence[int] = TASK_SIZES,
                 piece_sizes: Sequence[int] = PIECE_SIZES, steps: int = 3, warmup: int = 2):
        from soapsearch.executor import Executor, TrainConfig

        self.task_sizes, self.piece_sizes, self.steps = list(task_sizes), list(piece_sizes), steps
        self.runs: dict[str, list[Callable[[], Any]]] = {}
        self.pieces: list[int] = []
        self.piece_bytes = 0
        wanted = {"data_parallel": set(task_sizes), "one_device": set(piece_sizes),
                  "round_robin": set(piece_sizes)}
        for k in sorted(set(task_sizes) | set(piece_sizes)):
            model, batch, graph = build_chain(k, ROWS_PER_DEVICE * world)
            for name, plan in chain_plans(graph, world).items():
                if k not in wanted[name]:
                    continue
                ex = Executor(graph, plan, model.state_dict(), batch, TrainConfig(), "cpu")
                self.runs.setdefault(name, []).append(ex.step)
                if name == "round_robin":
                    count, self.piece_bytes = received_pieces(graph, plan)
                    self.pieces.append(count)
        for fns in self.runs.values():
            for fn in fns:
                for _ in range(warmup):
                    fn()

    def round(self) -> dict[str, list[float]]:
        return {name: [median_slowest(step_times(fn, self.steps)) for fn in fns] for name, fns in self.runs.items()}

    def result(self, rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"task_sizes": self.task_sizes, "piece_sizes": self.piece_sizes, "pieces": self.pieces,
                "piece_bytes": self.piece_bytes, "rounds": list(rounds)}
