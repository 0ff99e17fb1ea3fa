"""Measure this machine as N torch.distributed processes see it, and write ``calibrated-cpu-N``.

* point-to-point: ping-pong between every rank pair (i < j) over message sizes, one-way time =
  round trip / 2, the trimmed mean (``fit.trimmed_mean``) of ``repeats`` rounds after
  ``warmup`` (a round: one exchange of every size for every pair, then a round of the overhead
  probe); fitted to alpha + s/B (``fit.py``). A mean, not a median: on cores shared with other
  work a receiver's wake-up costs ~0.2 or ~2 ms by turns, and a plan's many messages cost their
  count times the mean;
* sending: the seconds rank 0 spends inside ``isend`` to rank 1 with the receive posted first
  (as the executor posts its receives ahead), up to 4 MiB, fitted to send_latency + s /
  send_bandwidth (``fit.fit_alpha_beta``): gloo copies the message into the socket in the
  calling thread, so a sending process computes nothing meanwhile; put on the links
  (``Calibration.hold_sends``);
* all-reduce over all ranks at the same sizes, against the ring formula on the fitted alpha, B,
  and fitted to that formula's slope on its own: the links' ``collective_bandwidth`` (sending
  both ways at once and summing on the cores that copy, gloo's ring moves ~half as fast);
* compute: float32 matmul FLOP/s (2·n³ per n×n product) and copy bandwidth (read + write =
  2·bytes), each from blocks of back-to-back calls long enough to span many scheduler slices,
  on all N processes at once and then on each alone: the topology's devices get the slowest
  solo figures and, as ``contention``, how much slower they run all at once (processes sharing
  cores, caches and memory bandwidth; the simulator slows each compute task by how many of
  them compute with it); the time of [m, 1024] × [1024, 1024] products of m = 4..64 rows
  alone, whose half-performance length n½ the devices carry (``fit.fit_gemm_half``); and the
  eager dispatch overhead of one tiny op (what the analytical model calls launch overhead);
* the executor's overheads, on all N processes: probe chains trained by the real ``Executor``
  (``overhead.py``), fitted to a per-task figure beyond the kernels of the cost model the plans
  will be simulated with (analytical or profiled), a
  per-received-piece figure beyond the link (one for one-way pieces, one for pieces exchanged
  between processes that all compute) and a per-collective figure beyond the ring formula
  (``fit.fit_overheads``) that every device of the topology carries.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from simulator.cost import CostModel, get_cost_model
from simulator.devices import OVERHEAD_FIELDS
from simulator.profiled import ROUNDS, ProfiledCostModel, cache_beside, default_cache_path, plan_partitions
from simulator.topology import Topology
from soapsearch.calibrate._spawn import rank_threads, spawn, threads_per_process
from soapsearch.calibrate.timing import slowest_median, step_times
from soapsearch.calibrate.fit import (build_topology, device_kind, fit_alpha_beta, fit_collective_bandwidth,
                                     fit_gemm_half, fit_overheads, ring_allreduce_seconds, trimmed_mean)
from soapsearch.calibrate.overhead import OverheadProbe, probe_chains, probe_simulator, unit_kernel_seconds
from strategies import Strategy, baseline
from strategies.lowering import lower
from strategies.serialize import atomic_write_text

__all__ = ["DEFAULT_SIZES", "Calibration", "calibrate", "fit_executor_overheads", "measure", "report_path",
           "warm_profile"]

DEFAULT_SIZES = tuple(1 << k for k in range(10, 25, 2))
"""1 KiB, 4 KiB, ... 16 MiB (powers of 4)."""
MATMUL_N = 384
GEMM_ROWS = (4, 8, 16, 32, 64)
"""Rows of the [m, GEMM_K] × [GEMM_K, GEMM_K] products (a linear layer's forward) timed alone
per process to fit the half-performance length n½ (``fit.fit_gemm_half``)."""
GEMM_K = 1024
SEND_FIT_MAX_BYTES = 4 << 20
"""The largest message whose send call is timed: beyond, the socket's buffer fills and gloo's own
thread writes the rest, so the time in the call falls below the line of the smaller messages."""
COPY_BYTES = 32 << 20
BLOCK_S = 0.05
"""Seconds of back-to-back calls per throughput block (``_per_call_time``): many scheduler slices."""


@dataclass
class Calibration:
    """What ``measure`` found; ``to_json`` is the fit report written beside the topology."""

    nproc: int
    threads: int
    cores: int
    kind: str
    alpha: float
    """Fitted per-message latency, seconds."""
    bandwidth: float
    """Fitted point-to-point bandwidth, bytes/s."""
    r2: float
    allreduce_ratio: float
    """Median over sizes of measured / ring-formula all-reduce time with the point-to-point
    alpha and B (nan for one process)."""
    collective_bandwidth: float | None
    """The ring bandwidth fitted to the measured all-reduce (``fit_collective_bandwidth``;
    None for one process): the calibrated links' ``collective_bandwidth``."""
    collective_r2: float
    flops: list[float]
    """float32 matmul FLOP/s of each process, all running at once."""
    memory_bandwidth: list[float]
    """Copy bandwidth of each process (2·bytes / s), all running at once."""
    solo_flops: list[float]
    """float32 matmul FLOP/s of each process running alone (the others waiting)."""
    solo_memory_bandwidth: list[float]
    """Copy bandwidth of each process running alone."""
    op_overhead: float
    """Median seconds of one tiny eager op (dispatch only), worst process."""
    gemm_seconds: list[list[float]] = field(default_factory=list)
    """[[rows m, seconds], ...]: a [m, 1024] × [1024, 1024] product alone, slowest process."""
    gemm_half: float = 0.0
    """The products' half-performance length n½ fitted on ``gemm_seconds`` against the slowest
    solo peak (``fit_gemm_half``; ``DeviceSpec.gemm_half``)."""
    task_overhead: float = 0.0
    """Seconds per forward or backward task of a partition beyond the cost model's kernels
    (framework dispatch, autograd, the executor's own work; ``fit_overheads``)."""
    message_overhead: float = 0.0
    """Executor seconds per received one-way point-to-point piece beyond alpha + s/B
    (``fit_overheads``)."""
    exchange_overhead: float = 0.0
    """The same per exchanged piece (its op sends one back: ``DeviceSpec.exchange_overhead``)."""
    collective_overhead: float = 0.0
    """Executor host seconds per collective on each member device beyond the ring formula."""
    overheads: dict[str, Any] = field(default_factory=dict)
    """The probe chains' raw times, and the overhead fit's per-round figures and counts
    (``OverheadFit``'s fields but the overheads)."""
    p2p: dict[str, list[list[float]]] = field(default_factory=dict)
    """"i-j" -> [[bytes, one-way seconds], ...]."""
    send_call: list[list[float]] = field(default_factory=list)
    """[[bytes, seconds rank 0 spends inside isend to rank 1, the receive posted], ...]."""
    send_latency: float = 0.0
    send_bandwidth: float | None = None
    """``fit_alpha_beta`` of ``send_call``: a send holds the sender's host send_latency + bytes
    / send_bandwidth (``Link.send_latency``, ``send_bandwidth``; None: one process)."""
    hold_sends: bool = True
    """Whether the calibrated links carry the send figures (``Link.send_latency``,
    ``send_bandwidth``); a report that says false keeps them as figures reported only, and its
    topology's sends hold no sender."""
    allreduce: list[list[float]] = field(default_factory=list)
    """[[bytes, measured s, ring formula s], ...]."""
    profile_cache: str | None = None
    """The ProfiledCostModel cache the overheads were fitted with and warmed for ``model``."""
    cost_model: str = "analytical"
    """The cost model the overheads are beyond: simulate the plans with the same one."""

    @property
    def shared(self) -> bool:
        return self.kind != "cpu"

    @property
    def contention(self) -> float:
        """How much slower a process computes with all running at once than alone: the
        geometric mean of the slowest processes' FLOP/s and copy-bandwidth ratios, solo /
        together (>= 1; ``DeviceSpec.contention``); 1 for one process (nothing to share)."""
        if self.nproc == 1:
            return 1.0
        ratio = math.sqrt(min(self.solo_flops) / min(self.flops)
                          * min(self.solo_memory_bandwidth) / min(self.memory_bandwidth))
        return max(1.0, ratio)

    def topology(self) -> Topology:
        """The calibrated topology: every process the slowest measured one (the plan must
        run on any of them; the spread is in the report)."""
        return self.with_overheads({f: getattr(self, f) for f in OVERHEAD_FIELDS})

    def with_overheads(self, overheads: Mapping[str, float]) -> Topology:
        """The calibrated topology with these overheads (by ``DeviceSpec`` field name, absent:
        0; the fit simulates its probe on it)."""
        return build_topology(self.nproc, self.alpha, self.bandwidth, min(self.solo_flops),
                              min(self.solo_memory_bandwidth), self.kind, collective_bandwidth=self.collective_bandwidth,
                              contention=self.contention, gemm_half=self.gemm_half,
                              **({"send_bandwidth": self.send_bandwidth, "send_latency": self.send_latency}
                                 if self.hold_sends else {}), **overheads)

    def to_json(self) -> dict[str, Any]:
        return {"format": "soapsearch.calibration", "version": 1, "shared_cores": self.shared,
                "contention": self.contention, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "calibration report") -> Calibration:
        """The calibration ``to_json`` wrote (its fit report); older reports lack the send
        figures (sends then do not hold the sender)."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}: a {type(obj).__name__}: a calibration report is a JSON object")
        if obj.get("format") != "soapsearch.calibration" or obj.get("version") != 1:
            raise ValueError(f"{where}: format {obj.get('format')!r} version {obj.get('version')!r}: "
                             "not a soapsearch.calibration report of version 1")
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in obj and f.default is MISSING
                   and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"{where}: missing {missing}: a report written by soapsearch calibrate has them")
        bw, lat = obj.get("send_bandwidth"), obj.get("send_latency", 0.0)
        if bw is not None and not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise ValueError(f"{where}: send_bandwidth = {bw!r}: must be a finite number > 0 or null")
        if not (isinstance(lat, (int, float)) and math.isfinite(lat) and lat >= 0):
            raise ValueError(f"{where}: send_latency = {lat!r}: must be a finite number >= 0")
        return cls(**{k: v for k, v in obj.items() if k in names})


def _per_call_time(fn, blocks: int, warmup: int) -> float:
    """Seconds per call of ``fn`` run back to back: the median over ``blocks`` blocks of at
    least ``BLOCK_S`` each of elapsed / calls. All processes run their blocks at once, each
    spanning many scheduler slices, so processes sharing cores measure their share; a single
    call of a few ms can run whole inside one slice, uncontended, and time the unshared speed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(blocks):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= BLOCK_S:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def _median_time(fn, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ping_pong(rank: int, i: int, j: int, buf: torch.Tensor) -> float:
    """One round trip of ``buf`` between ranks i and j; seconds (on both)."""
    t0 = time.perf_counter()
    if rank == i:
        dist.send(buf, j)
        dist.recv(buf, j)
    else:
        dist.recv(buf, i)
        dist.send(buf, i)
    return time.perf_counter() - t0


def _send_call(rank: int, buf: torch.Tensor, repeats: int, warmup: int) -> float:
    """Seconds rank 0 spends inside ``isend`` of ``buf`` to rank 1 (trimmed mean), whose receive is
    posted first (the executor posts its receives ahead); 0 on the other ranks."""
    times = []
    for _ in range(warmup + repeats):
        work = dist.irecv(buf, 0) if rank == 1 else None
        dist.barrier()
        if rank == 0:
            time.sleep(1e-3)  # the receive is posted
            t0 = time.perf_counter()
            work = dist.isend(buf, 1)
            times.append(time.perf_counter() - t0)
        if work is not None:
            work.wait()
    return trimmed_mean(times[warmup:]) if rank == 0 else 0.0  # a plan's sends cost their count times the mean


def _worker(rank: int, world: int, sizes: Sequence[int], repeats: int, warmup: int,
            overhead_rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"p2p": {}, "allreduce": []}
    pairs = [(i, j) for i in range(world) for j in range(i + 1, world)]
    bufs = {size: torch.zeros(size, dtype=torch.uint8) for size in sizes}
    one_way: dict[tuple[int, int], dict[int, list[float]]] = {pair: {s: [] for s in sizes} for pair in pairs}
    probe = OverheadProbe(world) if overhead_rounds else None
    probe_rounds = []
    # Rounds: one ping-pong of every size between every pair (one pair at a time, the others
    # wait at the barrier), then one round of the overhead probe; load from elsewhere that
    # comes and goes thus falls on every size and on both alike.
    for r in range(warmup + max(repeats, overhead_rounds)):
        if r < warmup + repeats:
            for pair in pairs:
                dist.barrier()
                if rank in pair:
                    for size in sizes:
                        one_way[pair][size].append(_ping_pong(rank, *pair, bufs[size]) / 2)
        if probe is not None and warmup <= r < warmup + overhead_rounds:
            probe_rounds.append(probe.round())
    for (i, j), per_size in one_way.items():
        if rank == i:
            out["p2p"][f"{i}-{j}"] = [[s, trimmed_mean(t[warmup:])] for s, t in per_size.items()]
    if world > 1:
        out["send_call"] = [[s, _send_call(rank, bufs[s], repeats, warmup)] for s in sizes if s <= SEND_FIT_MAX_BYTES]
    if probe is not None:
        out["overheads"] = probe.result(probe_rounds)
    dist.barrier()
    for size in sizes:
        buf = torch.zeros(max(size // 4, 1), dtype=torch.float32)
        times = step_times(lambda: dist.all_reduce(buf), warmup + repeats)
        out["allreduce"].append([size, slowest_median(times[warmup:])])
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    src, dst = torch.randn(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    x, y = torch.ones(1), torch.ones(1)
    flops = lambda: 2 * MATMUL_N ** 3 / _per_call_time(lambda: torch.mm(a, b), max(repeats, 5), warmup)  # noqa: E731
    copy = lambda: 2 * COPY_BYTES / _per_call_time(lambda: dst.copy_(src), max(repeats, 5), warmup)  # noqa: E731
    dist.barrier()  # from here all processes compute at once
    out["flops"] = flops()
    dist.barrier()
    out["memory_bandwidth"] = copy()
    out["op_overhead"] = _median_time(lambda: torch.add(x, y), 200, 20)
    weight = torch.randn(GEMM_K, GEMM_K)
    rows = [torch.randn(m, GEMM_K) for m in GEMM_ROWS]
    for r in range(world):  # then each alone, the others waiting
        dist.barrier()
        if r == rank:
            out["solo_flops"], out["solo_memory_bandwidth"] = flops(), copy()
            out["gemm_seconds"] = [_per_call_time(lambda x=x: F.linear(x, weight), max(repeats, 5), warmup)
                                   for x in rows]
    dist.barrier()
    return out


def measure(nproc: int, backend: str = "gloo", sizes: Sequence[int] = DEFAULT_SIZES, *,
            repeats: int = 7, warmup: int = 2, overhead_rounds: int = 5,
            cost: CostModel | None = None) -> Calibration:
    """Start ``nproc`` processes and measure (see the module docstring); fit alpha and B over
    the pooled points of every pair (one shared-memory mesh: one figure for all links), then
    the executor's overheads (``overhead_rounds`` rounds of the probe chains; 0: skip, leaving
    every overhead 0) beyond what ``cost`` (default analytical) charges the probe's kernels:
    fit them with the cost model the plans will be simulated with."""
    if nproc < 1:
        raise ValueError(f"calibrate: nproc = {nproc}: must be >= 1")
    if backend != "gloo":
        raise ValueError(f"calibrate: backend {backend!r}: calibrate measures gloo (CPU processes) only")
    sizes = sorted(int(s) for s in sizes)
    if overhead_rounds < 0:
        raise ValueError(f"calibrate: overhead_rounds = {overhead_rounds}: must be >= 0")
    results = spawn(_worker, nproc, (tuple(sizes), repeats, warmup, overhead_rounds), backend)
    threads, cores = threads_per_process(nproc), os.cpu_count() or 1
    p2p = {k: v for r in results for k, v in r["p2p"].items()}
    points = [pt for v in p2p.values() for pt in v]
    if points:
        alpha, bandwidth, r2 = fit_alpha_beta([p[0] for p in points], [p[1] for p in points])
    else:  # one process: nothing to send; keep local-cpu-1's figures
        alpha, bandwidth, r2 = 20e-6, 2e9, float("nan")
    allreduce = [[s, t, ring_allreduce_seconds(nproc, s, alpha, bandwidth)] for s, t in results[0]["allreduce"]]
    ratios = [t / f for _, t, f in allreduce if f > 0]
    ring, ring_r2 = None, float("nan")
    if nproc > 1 and len(allreduce) > 1:
        try:
            ring, ring_r2 = fit_collective_bandwidth(nproc, [s for s, _, _ in allreduce], [t for _, t, _ in allreduce])
        except ValueError as e:  # e.g. times that do not grow with the size on a loaded machine
            warnings.warn(f"calibrate: no ring bandwidth fitted ({e}); ring collectives use the link bandwidth",
                          RuntimeWarning, stacklevel=2)
    cal = Calibration(
        nproc, threads, cores, device_kind(nproc, threads, cores), alpha, bandwidth, r2,
        statistics.median(ratios) if ratios else float("nan"), ring, ring_r2,
        [r["flops"] for r in results], [r["memory_bandwidth"] for r in results],
        [r["solo_flops"] for r in results], [r["solo_memory_bandwidth"] for r in results],
        max(r["op_overhead"] for r in results), p2p=p2p, allreduce=allreduce)
    if nproc > 1:
        cal.send_call = results[0]["send_call"]
        try:
            cal.send_latency, cal.send_bandwidth, _ = fit_alpha_beta([s for s, _ in cal.send_call],
                                                                     [t for _, t in cal.send_call])
        except ValueError as e:  # e.g. send times that do not grow with the size on a loaded machine
            warnings.warn(f"calibrate: no send time fitted ({e}); sends do not hold the sender",
                          RuntimeWarning, stacklevel=2)
    cal.gemm_seconds = [[m, max(r["gemm_seconds"][i] for r in results)] for i, m in enumerate(GEMM_ROWS)]
    cal.gemm_half = fit_gemm_half(GEMM_ROWS, [t for _, t in cal.gemm_seconds], min(cal.solo_flops), GEMM_K, GEMM_K)
    if overhead_rounds:  # every figure in the probe's result is already reduced over the ranks
        fit_executor_overheads(cal, results[0]["overheads"], get_cost_model("analytical") if cost is None else cost)
    return cal


def fit_executor_overheads(cal: Calibration, raw: Mapping[str, Any], cost: CostModel) -> None:
    """Fit ``cal``'s executor overheads (``OVERHEAD_FIELDS``) to the probe's measured ``raw``
    times beyond ``cost``'s kernels (``fit.fit_overheads``), simulating the probe on ``cal``'s
    own topology; the per-round figures and counts go to ``cal.overheads``. A profiled ``cost``
    times the probe's partitions first, in rounds, as a rank. Re-running it on a saved report
    (``Calibration.from_json``) refits the same measurements under the current simulator."""
    raw = {k: raw[k] for k in ("task_sizes", "piece_sizes", "microbatches", "rounds") if k in raw}
    topo = cal.topology()
    with rank_threads(cal.nproc):
        if isinstance(cost, ProfiledCostModel):
            cost.profile(part for *_, graph, plan in probe_chains(cal.nproc, raw["task_sizes"], raw["piece_sizes"],
                                                                   raw["microbatches"])
                         for part in plan_partitions(graph, lower(graph, plan), topo))
        kernel = unit_kernel_seconds(topo, cost)
        simulate = (probe_simulator(cal.with_overheads, cost, raw["task_sizes"], raw["piece_sizes"],
                                    raw["microbatches"]) if cal.nproc > 1 else None)
        fit = fit_overheads(raw, kernel, simulate)
    figures = fit._asdict()
    for f in OVERHEAD_FIELDS:
        setattr(cal, f, figures.pop(f))
    cal.overheads = {**raw, "kernel": kernel, **figures}


def warm_profile(model: str, topology: Topology, cache_path: str | os.PathLike, variant: str = "tiny",
                 plans: Sequence[Strategy] | None = None, rounds: int = ROUNDS) -> int:
    """Time every op partition of ``plans`` (default: every baseline plan) of ``model`` on
    ``topology`` into the ProfiledCostModel cache at ``cache_path``, in ``rounds`` interleaved
    rounds (``ProfiledCostModel.profile``), in this process, alone, with the threads one
    process gets: a device's solo speed, which the simulator slows by its ``contention`` while
    its node's other devices compute. Returns the number of cached measurements."""
    from soapsearch.executor import build_model
    from strategies.baselines import BASELINES

    graph = build_model(model, variant).graph
    if plans is None:
        plans = []
        for name in BASELINES:
            try:
                plans.append(baseline(name, graph, topology.num_devices))
            except ValueError:
                continue  # e.g. a batch the device count does not divide
    cost = ProfiledCostModel(cache_path=cache_path)
    try:
        with rank_threads(topology.num_devices):
            cost.profile((part for plan in plans for part in plan_partitions(graph, lower(graph, plan), topology)),
                         rounds)
    finally:
        cost.flush()
    return len(cost)


def report_path(topology_path: str | os.PathLike) -> Path:
    """Where the fit report of ``topology.json`` lives: ``topology.report.json``."""
    p = Path(topology_path)
    return p.with_name(f"{p.stem}.report.json")


def calibrate(nproc: int, backend: str = "gloo", sizes: Sequence[int] = DEFAULT_SIZES,
              model: str | None = None, *, out: str | os.PathLike | None = None,
              variant: str = "tiny", repeats: int = 7, overhead_rounds: int = 5,
              cost_model: str = "analytical") -> Topology:
    """Measure, build ``calibrated-cpu-N``; with ``out`` save it there and the fit report beside
    it (``report_path``). The executor's overheads are fitted beyond ``cost_model``'s kernel
    times; "profiled" times the probe's partitions into the profile cache
    (``<out stem>.profile.json`` beside ``out``, else the default cache), which plans on this
    topology should then be simulated with. With ``model`` that cache is also warmed for the
    model's baseline plans."""
    if cost_model not in ("analytical", "profiled"):
        raise ValueError(f"calibrate: cost_model {cost_model!r}: choose 'analytical' or 'profiled'")
    cache = None
    if cost_model == "profiled" or model is not None:
        cache = str(cache_beside(out) if out is not None else default_cache_path())
    cost = ProfiledCostModel(cache_path=cache) if cost_model == "profiled" else get_cost_model("analytical")
    try:
        cal = measure(nproc, backend, sizes, repeats=repeats, overhead_rounds=overhead_rounds, cost=cost)
    finally:
        if isinstance(cost, ProfiledCostModel):
            cost.flush()
    cal.profile_cache, cal.cost_model = cache, cost_model
    topo = cal.topology()
    if model is not None:
        warm_profile(model, topo, cache, variant)
    if out is not None:
        topo.save(out)
        atomic_write_text(report_path(out), json.dumps(cal.to_json(), indent=1) + "\n")
    return topo
