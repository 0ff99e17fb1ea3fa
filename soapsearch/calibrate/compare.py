"""Predicted vs measured: run a plan for real with the executor, simulate it, and line the two
up (iteration ms, per-device busy ms, relative error), optionally as Chrome traces side by side.

Measured iteration: every rank meets at a barrier, runs ``Executor.step``, and the step's time
is the slowest rank's; the median over ``steps`` steps after ``warmup`` (several plans take
turns step by step). Measured busy: the
executor's events of a device (forward/backward of one partition, which include gathering its
inputs, and the optimizer update) minus the time its receives waited, averaged over the
measured steps; the gradient sync and the loss value's sum (waits in them included) are in the
measured timeline but not in busy. Both are also split by phase (``PHASES``: forward, backward,
receives, sync+update), per device, to show where the two timelines part.
Relative error = (predicted - measured) / measured.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch

from simulator.cost import CostModel
from simulator.presets import get_topology
from simulator.result import SimResult
from simulator.simulate import simulate_plan
from simulator.topology import Topology
from soapsearch.calibrate._spawn import spawn
from strategies.serialize import read_plan

__all__ = ["BUSY", "PHASES", "CompareResult", "Measured", "compare", "run_plans", "simulate_file", "simulated_phases"]

BUSY = ("forward", "backward", "update")
"""The categories of the executor's events that count as a device's busy time."""
PHASES = ("forward", "backward", "receives", "sync+update")
"""The columns of ``CompareResult``'s phases. Simulated, a device's compute lane: its forward and
backward tasks and its sends' host time, its message and exchange overheads, and its collectives' host work (bucket
copies, collective overheads; mid-step sums' too) and update. Measured, per step: the
executor's forward and backward steps (mid-step sums in them), less the receive waits inside
them, which are the receives column, and its gradient sync, loss sum and update."""
_SIMULATED = {"forward": "forward", "backward": "backward", "recv": "receives", "reduce": "sync+update",
              "allreduce": "sync+update", "update": "sync+update", "send": "forward", "grad_send": "backward"}
"""A send's host time is in the executor's forward or backward step that sends."""
_MEASURED = {"forward": "forward", "backward": "backward", "gradient sync": "sync+update", "loss": "sync+update",
             "update": "sync+update"}


@dataclass
class Measured:
    """One plan run for real on ``nproc`` processes."""

    step_ms: list[float]
    """Each measured step, slowest rank."""
    busy_ms: list[float]
    """Per device: partition time minus receive waits, per step."""
    wait_ms: list[float]
    """Per device: time its receives waited, per step."""
    events: list[list[dict[str, Any]]]
    """Per rank: the last measured step's Chrome events, µs from that step's start."""
    phase_ms: list[dict[str, float]]
    """Per rank: ms per step in each of ``PHASES``."""

    @property
    def iteration_ms(self) -> float:
        return statistics.median(self.step_ms)


@dataclass
class CompareResult:
    plan: str
    model: str
    topology: str
    cost_model: str
    predicted_ms: float
    measured_ms: float
    step_ms: list[float]
    predicted_busy_ms: list[float]
    measured_busy_ms: list[float]
    measured_wait_ms: list[float]
    predicted_phase_ms: list[dict[str, float]]
    """Per device: simulated ms in each of ``PHASES`` (its compute lane)."""
    measured_phase_ms: list[dict[str, float]]
    """Per device: measured ms per step in each of ``PHASES``."""

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_ms - self.measured_ms) / self.measured_ms

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rel_error": self.rel_error}

    def table(self) -> str:
        fmt = lambda xs: " ".join(f"{x:8.2f}" for x in xs)  # noqa: E731
        return "\n".join([
            f"plan {self.plan} ({self.model}) on {self.topology}, {self.cost_model} cost model",
            f"  iteration ms   predicted {self.predicted_ms:8.2f}  measured {self.measured_ms:8.2f}"
            f"  error {self.rel_error:+.1%}  (steps: {fmt(self.step_ms)})",
            f"  busy ms/device predicted {fmt(self.predicted_busy_ms)}",
            f"                 measured  {fmt(self.measured_busy_ms)}  (+ receive waits {fmt(self.measured_wait_ms)})",
            "  ms by phase        " + "".join(f"{p:>12s}" for p in PHASES)]
            + [f"  {side} device {d:<2d}" + "".join(f"{phases[d].get(p, 0.0):12.2f}" for p in PHASES)
               for d in range(len(self.measured_phase_ms))
               for side, phases in (("predicted", self.predicted_phase_ms), ("measured ", self.measured_phase_ms))])


def _worker(rank: int, world: int, plans: Sequence[str], model: str, variant: str, steps: int,
            warmup: int) -> list[dict[str, Any]]:
    from soapsearch.executor import Executor, TrainConfig, build_model

    built = build_model(model, variant, seed=0)
    runs = []
    for path in plans:
        ex = Executor(built.graph, read_plan(path, built.graph).strategy, built.model.state_dict(),
                      built.inputs, TrainConfig(), "cpu", trace=True)
        waits: list[tuple[float, float]] = []  # (start µs, seconds) of each receive's wait

        def timed_recv(*a, recv=ex.p2p.recv, waits=waits, **kw):
            t0 = time.perf_counter()
            try:
                return recv(*a, **kw)
            finally:
                waits.append((t0 * 1e6, time.perf_counter() - t0))
        ex.p2p.recv = timed_recv  # instance attribute: counts receive waits, changes nothing else
        runs.append({"ex": ex, "waits": waits, "step_s": [], "busy": 0.0, "wait": 0.0, "events": [],
                     "phases": dict.fromkeys(PHASES, 0.0)})
    for k in range(warmup + steps):  # plans interleaved step by step: a burst of load from
        for run in runs:             # elsewhere falls on every plan alike
            ex, waits = run["ex"], run["waits"]
            ex.events.clear()
            waits.clear()
            dist.barrier()
            t0 = time.perf_counter()
            ex.step(seed=k)
            t1 = time.perf_counter()
            if k < warmup:
                continue
            waited = sum(dt for _, dt in waits)
            run["step_s"].append(t1 - t0)
            run["busy"] += sum(e["dur"] for e in ex.events if e["cat"] in BUSY) * 1e-6 - waited
            run["wait"] += waited
            _add_phases(run["phases"], ex.events, waits)
            run["events"] = [dict(e, ts=e["ts"] - t0 * 1e6) for e in ex.events]
    out = []
    for run in runs:
        slowest = torch.tensor(run["step_s"], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out.append({"step_ms": (slowest * 1e3).tolist(), "busy_ms": run["busy"] * 1e3 / steps,
                    "wait_ms": run["wait"] * 1e3 / steps, "events": run["events"],
                    "phase_ms": {p: us * 1e-3 / steps for p, us in run["phases"].items()}})
    return out


def run_plans(plans: Sequence[str | os.PathLike], model: str, nproc: int, *, variant: str = "tiny",
              steps: int = 5, warmup: int = 2) -> list[Measured]:
    """Run each plan file (all for ``nproc`` devices) for real, in one launch of ``nproc``
    gloo processes (each with cores // nproc threads, as ``soapsearch run``). The plans take
    turns, one step each, so that load from other processes on shared cores falls on all
    of them alike; each plan's steps are still timed one by one."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"compare: steps ({steps}) must be >= 1 and warmup ({warmup}) >= 0")
    ranks = spawn(_worker, nproc, ([str(p) for p in plans], model, variant, steps, warmup))
    return [Measured(ranks[0][i]["step_ms"], [r[i]["busy_ms"] for r in ranks],
                     [r[i]["wait_ms"] for r in ranks], [r[i]["events"] for r in ranks],
                     [r[i]["phase_ms"] for r in ranks])
            for i in range(len(plans))]


def _add_phases(phases: dict[str, float], events: Sequence[dict[str, Any]],
                waits: Sequence[tuple[float, float]]) -> None:
    """Add one step's µs per phase: each event's time to its phase, less the receive waits
    (start µs, seconds) that fell inside it, which go to "receives"."""
    for e in events:
        phases[_MEASURED[e["cat"]]] += e["dur"]
    starts = [e["ts"] for e in events]
    for t0, dt in waits:
        i = bisect.bisect_right(starts, t0) - 1  # the event running when the wait began
        if i >= 0:
            phases[_MEASURED[events[i]["cat"]]] -= dt * 1e6
        phases["receives"] += dt * 1e6


def simulated_phases(sim: SimResult, num_devices: int) -> list[dict[str, float]]:
    """Per device: ms of its compute lane's tasks in each of ``PHASES`` (a timeline's)."""
    out = [dict.fromkeys(PHASES, 0.0) for _ in range(num_devices)]
    for _, device, lane, start, end, category in sim.timeline:
        phase = _SIMULATED.get(category)
        if lane == "compute" and phase is not None and device < num_devices:
            out[device][phase] += (end - start) * 1e3
    return out


def _cost(cost_model: CostModel | str, topology: Topology | str | os.PathLike) -> CostModel:
    from simulator.profiled import cost_model_for

    return cost_model if not isinstance(cost_model, str) else cost_model_for(cost_model, topology)


def simulate_file(plan_path: str | os.PathLike, model: str, topology: Topology | str | os.PathLike,
                  cost_model: CostModel | str = "analytical", variant: str = "tiny", graph=None):
    """(SimResult with timeline, Topology) of a plan file on ``topology``."""
    if graph is None:
        from soapsearch.executor import build_model
        graph = build_model(model, variant, seed=0).graph
    topo = topology if isinstance(topology, Topology) else get_topology(topology)
    plan = read_plan(plan_path, graph).strategy
    return simulate_plan(graph, plan, topo, _cost(cost_model, topology), timeline=True), topo


def write_traces(trace_dir: str | os.PathLike, sim, measured: Measured) -> Path:
    """``simulated.json``, ``measured.rank<R>.json`` and ``side_by_side.json`` (simulated
    devices as pids 0.., measured ranks as pids 1000+R) in ``trace_dir``; returns the last."""
    d = Path(trace_dir)
    d.mkdir(parents=True, exist_ok=True)
    simulated = sim.chrome_trace()
    (d / "simulated.json").write_text(json.dumps(simulated))
    merged = [dict(e, args={"name": f"simulated {e['args']['name']}"}) if e.get("name") == "process_name"
              else e for e in simulated["traceEvents"]]
    for rank, events in enumerate(measured.events):
        (d / f"measured.rank{rank}.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        merged += [dict(e, pid=1000 + rank) for e in events]
        merged.append({"name": "process_name", "ph": "M", "pid": 1000 + rank, "args": {"name": f"measured rank {rank}"}})
    out = d / "side_by_side.json"
    out.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
    return out


def compare(plan_path: str | os.PathLike, model_spec: str, topology: Topology | str | os.PathLike, *,
            variant: str = "tiny", steps: int = 5, warmup: int = 2, cost_model: CostModel | str = "analytical",
            trace_dir: str | os.PathLike | None = None, measured: Measured | None = None) -> CompareResult:
    """Run ``plan_path`` for real on as many processes as it has devices (unless ``measured``
    is given), simulate it on ``topology``, and line them up; ``trace_dir`` gets both timelines."""
    from soapsearch.executor.launch import plan_devices

    sim, topo = simulate_file(plan_path, model_spec, topology, cost_model, variant)
    if measured is None:
        measured = run_plans([plan_path], model_spec, plan_devices(plan_path), variant=variant,
                             steps=steps, warmup=warmup)[0]
    if trace_dir is not None:
        write_traces(trace_dir, sim, measured)
    n = len(measured.busy_ms)
    name = cost_model if isinstance(cost_model, str) else type(cost_model).__name__
    return CompareResult(str(plan_path), model_spec, topo.name, name, sim.iteration_ms, measured.iteration_ms,
                         measured.step_ms, [b * 1e3 for b in sim.busy_time[:n]], measured.busy_ms, measured.wait_ms,
                         simulated_phases(sim, n), measured.phase_ms)
