"""The factorization sweep: the data × tensor × pipeline factorizations of ``globalmove.py``
(with micro-batches, schedule, sharding level, recompute and sequence parallel) scored
best-first before the chains run, so that a search at scale starts from the best of the space
that matters there, not from a few drawn ones.

Every factorization gets a closed-form ``Estimate`` first (no lowering): its time is the
heaviest stage's compute (the blocks' FLOPs over the stages, the ops outside them on one) over
its devices' peak with the pipeline's bubble (Narayanan et al., SC'21: (p − 1)/m of the
compute), the tensor-parallel all-reduces of each block's output (Shoeybi et al. 2019: one
forward and one backward per block, a second forward with recompute) and the data-parallel gradient
all-reduce (ZeRO-3: the weights gathered again per micro-batch, Rajbhandari et al. SC'20), each
ring moving 2(g − 1)/g of its bytes at its group's bandwidth, the gradients' half of it in the
plan's reduce dtype (``strategies.precision.reduce_scale``: twice the bytes for a bf16/fp16
plan reducing in float32), and at ZeRO-2/3, where each weighted op's group makes rings of its
own every micro-batch (FSDP2's per-group reduce-scatter and all-gathers), each ring's g − 1
steps of its route's latency (Hockney's α); its memory is the weights'
states over the devices that hold them (ZeRO's levels; the ops outside the blocks on one
stage, a tied weight once per op reading it), the activations in flight (1F1B: min(p, m) of
the m micro-batches; recompute: each layer's input and one layer live; those between the
blocks cut tp ways with sequence parallelism alone, Korthikanti et al. 2022) and the
tensor-parallel collectives' buffers (each block's result per micro-batch in flight and one
micro-batch's gradient buffers), or, where more, the gradient buckets' flat tensors at the
step's sync (levels 0 and 1, in the reduce dtype: ``strategies.collective_buffers``), when the
activations are freed. Then, best-first
(``_Order``: those estimated to fit first, the less memory first on a tie; the first of each tensor × pipeline degrees ×
micro-batches before the others; the estimate corrected by the least simulated / estimated
ratio seen at the plan's tensor × pipeline degrees, else at its pipeline degree, else
anywhere; a plan is not tried where its estimate times the least ratio seen at its degrees and
schedule, or its estimate alone where none is timed, is no less than the best time simulated:
a branch and bound), each plan is lowered and its peak memory
(``simulator.memory.peak_memory``, a hundredth of a simulation) read: a plan that does not fit
is not timed; one that fits is simulated. A plan equal to one already scored (a baseline:
data parallel, ZeRO-1 and megatron are factorizations; or another factorization's, a
sharding level on one data-parallel device) takes that result. The order is fixed
by the graph and topology, so the sweep is deterministic; it stops where no plan is left that
its bound lets through, at its deadline or after ``limit`` simulations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from simulator.memory import peak_memory
from simulator.result import SimResult
from simulator.simulate import FOLD_FROM, Lowerings
from simulator.topology import Topology
from soapsearch.search.globalmove import Factorization, GlobalMoves, divisors, layers_of, pipeline_degrees
from soapsearch.search.mcmc import ChainStats, consider, plan_cost, rank
from soapsearch.search.pace import SUMMARY, Pace
from soapsearch.search.scratch import Scratch
from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.megatron import megatron_blocks
from strategies.precision import reduce_scale
from strategies.strategy import COMPUTE_DTYPES, Strategy

__all__ = ["SWEEP_SHARE", "SWEEP_TIMINGS", "SWEPT_BASELINES", "Estimate", "Swept", "estimate", "megatron_lm_factors",
           "sweep", "swept_starts"]

SWEEP_SHARE = 0.5
"""The share of the time budget left after the baselines that a search's sweep may spend."""
SWEEP_TIMINGS = 8
"""Plans a sweep times under a proposal budget alone (no deadline)."""
SWEPT_BASELINES = ("data_parallel", "zero1", "megatron", "megatron_lm")
"""The baselines a search with the sweep scores: the factorizations among them (their plans are
the sweep's, whose results it reuses); hybrid, FSDP, model parallel, OWT, single device and the
pipeline baseline's six runs are not scored (each half a minute or more at 64 devices)."""

_MIXED = {"bf16": 2, "fp16": 2}
"""Bytes of a value in a mixed-precision plan's compute dtype."""
_OPTIMIZER_BYTES = {"adam": 8, "sgd": 0}
"""Optimizer state bytes per parameter (Adam's two fp32 moments)."""
_DUALS = 2
"""Gradient buffers live at once of a tensor-parallel block's collectives, in units of the block's
output (the duals of its all-reduce, or of its all-gather and reduce-scatter)."""


@dataclass(frozen=True)
class Estimate:
    """A factorization's closed-form iteration seconds and per-device peak bytes (an order
    for the sweep, not a prediction: the simulator scores the plans)."""

    seconds: float
    peak_bytes: float


@dataclass(frozen=True)
class _Shape:
    """What the estimates read off the graph and topology, once."""

    flops: float
    outside: float
    """FLOPs of the ops outside the blocks (embedding, head, loss: on one pipeline stage)."""
    params: float
    held_inside: float
    """Parameters of the blocks' ops (cut tp ways, spread over the stages)."""
    held_outside: float
    """Parameters of the ops outside the blocks, a weight counted on each op reading it (GPT's
    tied embedding and head): cut tp ways, on the heaviest stage whole."""
    activations: float
    """Bytes of every op's output at the full batch, in the plan's compute dtype."""
    between: float
    """The part of ``activations`` outside the blocks (cut tp ways only with sequence parallelism)."""
    block_out: float
    """Bytes of one block's output at the full batch (what a tensor-parallel all-reduce moves)."""
    layer_in: float
    """Bytes of every transformer layer's input together (what layer recompute keeps; every
    block's input where the blocks do not pair into layers)."""
    blocks: int
    layers: int
    value: int
    """Bytes of a weight or gradient in the compute dtype."""
    reduce: int
    """Bytes a gradient byte is summed in (``strategies.precision.reduce_scale``: 2 for a
    bf16/fp16 plan reducing in float32, else 1)."""
    master: int
    optimizer: int
    peak_flops: float
    capacity: float
    intra: float
    inter: float
    node: int
    weighted_inside: int
    """Ops inside the blocks with a trainable weight (each a group of its own at ZeRO-2/3)."""
    weighted_outside: int
    """Ops outside the blocks with a trainable weight (on the heaviest stage)."""
    intra_latency: float
    """Seconds of a ring step within a node (``Topology.route_latency`` of neighbours)."""
    inter_latency: float
    """Seconds of a ring step across nodes."""


def _shape(graph: OpGraph, topo: Topology, n: int, optimizer: str, precision: str,
           reduce_dtype: str = "compute") -> _Shape:
    blocks = megatron_blocks(graph)
    layered = blocks[0::2] if blocks and layers_of(graph) is not None else blocks  # each layer's attention block
    weights = {w.name: w.spec for node in graph for w in node.weights}
    itemsize = {s.dtype: s.nbytes // max(s.numel, 1) for s in weights.values()}
    model = max(itemsize.values(), default=4)
    value = _MIXED.get(precision, model)
    scale = value / model  # activations are stored in the compute dtype
    acts = sum(node.output.nbytes for node in graph if node.kind not in ("parameter", "constant"))
    inside = {op for cols, mid, row in blocks for op in (*cols, *mid, row)}
    between = sum(node.output.nbytes for node in graph if node.kind not in ("parameter", "constant")
                  and node.name not in inside)
    device = topo.devices[0]
    node = topo.node_size or n
    return _Shape(
        flops=float(graph.total_flops), outside=float(graph.total_flops - sum(
            graph[op].flops for cols, mid, row in blocks for op in (*cols, *mid, row))), params=float(sum(s.numel for s in weights.values())),
        held_inside=float(sum(s.numel for s in {w.name: w.spec for op in inside for w in graph[op].weights}.values())),
        held_outside=float(sum(w.spec.numel for node in graph if node.name not in inside for w in node.weights)),
        activations=acts * scale, between=between * scale,
        block_out=(graph[blocks[0][2]].output.nbytes * scale) if blocks else 0.0,
        layer_in=sum(graph[graph[b[0][0]].inputs[0]].output.nbytes for b in layered) * scale,
        blocks=len(blocks), layers=max(len(layered), 1), value=value,
        reduce=reduce_scale(reduce_dtype, COMPUTE_DTYPES[precision]) if precision in _MIXED else 1,
        master=4 if precision in _MIXED else 0,
        optimizer=_OPTIMIZER_BYTES.get(optimizer, 4), peak_flops=device.flops_for("bfloat16" if value == 2 else "float32"),
        capacity=float(device.memory_bytes), intra=topo.route_ring_bandwidth(0, 1) if n > 1 else float("inf"),
        inter=topo.route_ring_bandwidth(0, node) if node < n else float("inf"), node=node,
        weighted_inside=sum(1 for op in inside if any(w.trainable for w in graph[op].weights)),
        weighted_outside=sum(1 for nd in graph if nd.name not in inside and any(w.trainable for w in nd.weights)),
        intra_latency=topo.route_latency(0, 1) if n > 1 else 0.0,
        inter_latency=topo.route_latency(0, node) if node < n else 0.0)


def _ring(nbytes: float, group: int, span: int, shape: _Shape) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``group`` devices spread over ``span``
    consecutive ones: 2(g − 1)/g of the bytes at the slowest link it crosses."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / (shape.intra if span <= shape.node else shape.inter)


def _uses(shape: _Shape, p: int) -> float:
    """Weighted ops on the heaviest of ``p`` stages: the blocks' spread over the stages, the ops
    outside them on one."""
    return shape.weighted_inside / p + shape.weighted_outside


def _per_use_calls(f: Factorization) -> int:
    """Rings each weighted op's group makes per micro-batch at ZeRO-2/3 (``simulator.zero3``):
    its gradients' reduce-scatter; at level 3 also the weights' all-gathers before its forward
    and its backward, and before its recomputation."""
    return 1 + (2 + f.recompute if f.zero == 3 else 0)


def estimate(f: Factorization, n: int, shape: _Shape) -> Estimate:
    """``f``'s closed-form time and memory on ``n`` devices (module docstring); stages
    outermost, data parallel, tensor parallel innermost, as ``strategies.megatron`` places them."""
    t, p, m = f.tp, f.pp, f.microbatches
    d = max(n // (t * p), 1)
    heaviest = shape.flops - shape.outside + shape.outside * p  # the ops outside the blocks on one stage
    compute = heaviest * (4 if f.recompute else 3) / (n * shape.peak_flops) * (1 + (p - 1) / m)
    layers = shape.blocks / p
    tensor = layers * (3 if f.recompute else 2) * _ring(shape.block_out / d, t, t, shape)
    held = shape.held_inside / (t * p) + shape.held_outside / t  # parameters per device before ZeRO
    # level 0 all-reduces in the reduce dtype; levels 1-3 reduce-scatter in it and all-gather the
    # weights in the compute dtype (a ring's halves)
    wide = shape.reduce if f.zero == 0 else (1 + shape.reduce) / 2
    grads = _ring(held * shape.value * wide, d, d * t, shape)
    if f.zero == 3:  # two all-gathers (half a ring each) of the weights per micro-batch
        grads += m * _ring(held * shape.value, d, d * t, shape)
    if f.zero >= 2 and d > 1:  # per use: each weighted op's ring of d − 1 steps per micro-batch
        grads += m * _per_use_calls(f) * _uses(shape, p) * (d - 1) * (
            shape.intra_latency if d * t <= shape.node else shape.inter_latency)
    states = held * (shape.value * (1 if f.zero < 3 else 1 / d) + shape.value * (1 if f.zero < 2 else 1 / d)
                     + (shape.master + shape.optimizer) * (1 if f.zero < 1 else 1 / d))
    held_mb = min(p, m) if f.schedule == "1f1b" else m  # micro-batches whose activations a stage holds
    per = 1 / (d * m * p)  # a device's share of the full batch's bytes on one stage
    if f.recompute:  # each layer's input kept (Korthikanti et al. 2022 §4.3: 2sbh, /t with SP) and one layer live
        acts = (shape.layer_in / (t if f.sequence_parallel else 1) * held_mb
                + (shape.activations - shape.between) / shape.layers * p / t) * per
    else:
        acts = ((shape.activations - shape.between) / t + shape.between / (t if f.sequence_parallel else 1)) \
            * per * held_mb
    # tensor parallel, as strategies.collective_buffers keeps them: each block's collective
    # result per micro-batch held (under recompute with sequence parallelism the all-gathers are
    # gathered again and only the reduce-scatter shards, block_out / t, stay) and one block's
    # gradient buffers of its duals (each lives from its reader's backward to the dual's call)
    kept = shape.block_out / (t if f.recompute and f.sequence_parallel else 1)
    collective = (shape.blocks * kept * held_mb + shape.block_out * _DUALS) * per if t > 1 else 0.0
    # levels 0 and 1: every bucket's flat tensor held at the step's sync, in the reduce dtype
    # (level 1: padded to d chunks and the device's chunk of the sum besides)
    buckets = held * shape.value * shape.reduce * (1 if f.zero == 0 else (d + 1) / d) if f.zero < 2 and d > 1 else 0.0
    return Estimate(compute + tensor + grads, states + max(acts + collective, buckets))


def megatron_lm_factors(graph: OpGraph, topo: Topology, n: int, optimizer: str, precision: str,
                        reduce_dtype: str = "compute") -> tuple[int, int] | None:
    """The tensor × pipeline degrees of ``strategies.baselines.megatron_lm`` on ``n`` devices
    (one sequence a micro-batch, 1F1B, sequence parallelism, layers recomputed, ZeRO-1): of the
    degrees ``GlobalMoves`` factors (t ≤ 8 within a node, t > 1, p dividing the layers),
    the one ``estimate`` times fastest among those estimated to fit, else the one of least
    memory; None where the graph has no layers or the batch leaves no data-parallel degree.
    ``reduce_dtype``: what the plan sums gradients in (``Strategy.reduce_dtype``)."""
    layers = layers_of(graph)
    if not layers or not graph.batch_size:
        return None
    shape = _shape(graph, topo, n, optimizer, precision, reduce_dtype)
    out = []
    for t in (t for t in divisors(n) if 1 < t <= 8):
        for p in pipeline_degrees(n // t, len(megatron_blocks(graph)), len(layers)):
            d = n // (t * p)
            if graph.batch_size % d:
                continue
            e = estimate(Factorization(t, p, graph.batch_size // d, "1f1b", 1, True, True), n, shape)
            out.append((e.peak_bytes > shape.capacity, e.seconds if e.peak_bytes <= shape.capacity else e.peak_bytes,
                        t, p))
    return min(out)[2:] if out else None


@dataclass(frozen=True)
class Swept:
    """One factorization the sweep reached: its plan, and its result where it was timed
    (None: its peak memory does not fit, so it was not)."""

    factorization: Factorization
    plan: Strategy
    result: SimResult | None
    peak_bytes: int


def sweep(graph: OpGraph, topo: Topology, moves: GlobalMoves, optimizer: str, precision: str,
          evaluate: Callable[[Strategy], SimResult], cache: dict, deadline: float | None,
          limit: int | None, known: dict[Strategy, SimResult] | None = None,
          pace: Pace | None = None, reduce_dtype: str = "compute") -> list[Swept]:
    """The factorizations of ``moves`` best-first (``_Order``), each lowered with ``cache``
    (the evaluator's, so its simulation reuses the lowering) and timed by ``evaluate`` where
    its peak memory fits; a plan in ``known`` takes its result. Stops where no plan is left whose
    bound is under the best time simulated (``_Order.next``), where the next plan's
    memory check, or a fitting plan's simulation, would end past ``deadline``
    (``time.perf_counter()``; ``pace`` predicts them from those before, kinds "sweep/check" and
    "sweep/timed") or after ``limit`` timed plans, whichever first. ``reduce_dtype``: what the
    plans sum gradients in (``Strategy.reduce_dtype``), for the estimates."""
    n = moves.num_devices
    shape = _shape(graph, topo, n, optimizer, precision, reduce_dtype)
    order = _Order(moves.factorizations, {f: estimate(f, n, shape) for f in moves.factorizations}, shape.capacity)
    known = dict(known or {})  # grows with the timed plans: a factorization whose plan is another's
    capacity = [d.memory_bytes for d in topo.devices]
    out: list[Swept] = []
    timed = 0
    pace = Pace() if pace is None else pace
    best = None  # seconds of the best plan timed that fits
    while (f := order.next(best)) is not None:
        if not pace.fits("sweep/check", deadline) or (limit is not None and timed >= limit):
            break
        plan = moves.plan(f)
        if plan is None:
            continue
        result = known.get(plan)
        if result is None:
            trial = Scratch(cache)  # a plan that does not fit leaves nothing in the search's cache
            try:
                with pace.timed("sweep/check"):
                    peak = peak_memory(Lowerings(graph, plan, trial).first(topo, n >= FOLD_FROM), optimizer)  # copy 0's, expanded
            except PlanError:  # a rule the lowering alone checks (strategies.zero): not a plan
                continue
            if any(b > c for b, c in zip(peak, capacity)):
                out.append(Swept(f, plan, None, max(peak)))
                continue
            if not pace.fits("sweep/timed", deadline, SUMMARY):
                break
            trial.keep()  # its simulation reuses this lowering
            with pace.timed("sweep/timed"):
                result = known[plan] = evaluate(plan)
            timed += 1
        order.timed(f, result.iteration_time)
        if result.fits and (best is None or result.iteration_time < best):
            best = result.iteration_time
        out.append(Swept(f, plan, result, max(result.peak_memory_bytes)))
    return out


class _Order:
    """The factorizations in passes: those estimated to fit before the others, and in each the
    first of every tp × pp × micro-batches (in the estimate's order) before the rest, so the
    shapes come before their flags' variants. Within a pass, by the corrected estimate
    (``corrected``); the estimate's order on ties. ``next(best)`` leaves out every plan whose
    ``bound`` is no less than ``best``."""

    def __init__(self, factorizations: list[Factorization], est: dict[Factorization, Estimate], capacity: float):
        self.est = est
        order = sorted(factorizations, key=lambda f: (est[f].peak_bytes > capacity, est[f].seconds, est[f].peak_bytes))
        leads: dict[tuple, Factorization] = {}
        for f in order:
            leads.setdefault((est[f].peak_bytes > capacity, f.tp, f.pp, f.microbatches), f)
        first = set(leads.values())
        self.left = [((est[f].peak_bytes > capacity, f not in first), i, f) for i, f in enumerate(order)]
        self.ratio: dict[tuple, float] = {}
        """The least simulated / estimated ratio seen at each (tp, pp, schedule), (tp, pp), (pp,)
        and () (anywhere)."""

    def timed(self, f: Factorization, seconds: float) -> None:
        """``f`` simulated in ``seconds``: its degrees' ratios updated."""
        if self.est[f].seconds > 0:
            r = seconds / self.est[f].seconds
            for key in ((f.tp, f.pp, f.schedule), (f.tp, f.pp), (f.pp,), ()):
                self.ratio[key] = min(self.ratio.get(key, r), r)

    def bound(self, f: Factorization) -> float:
        """``f``'s estimated seconds times the least ratio seen at its tensor × pipeline degrees
        and schedule, the estimate itself where none is timed yet: what ``next`` compares with
        the best time (a ratio seen at other degrees or another schedule says little of ``f``'s:
        tensor parallelism's all-reduces and the schedule's bubble differ)."""
        return self.ratio.get((f.tp, f.pp, f.schedule), 1.0) * self.est[f].seconds

    def corrected(self, f: Factorization) -> float:
        """``f``'s estimated seconds times the least ratio seen at its tensor × pipeline
        degrees, else at its pipeline degree, else at any (an optimistic correction by what the
        simulator said, so degrees the estimate flatters are left once timed); the estimate
        itself before any plan is timed."""
        r = next((self.ratio[k] for k in ((f.tp, f.pp), (f.pp,), ()) if k in self.ratio), 1.0)
        return r * self.est[f].seconds

    def next(self, best: float | None = None) -> Factorization | None:
        """The next factorization to try (None: none left); with ``best`` (seconds: the best plan
        simulated so far), none whose ``bound`` is ``best`` or more."""
        if best is not None:
            self.left = [item for item in self.left if self.bound(item[2]) < best]
        if not self.left:
            return None
        at = min(range(len(self.left)), key=lambda k: (self.left[k][0], self.corrected(self.left[k][2]), self.left[k][1]))
        return self.left.pop(at)[2]


def swept_starts(graph: OpGraph, topo: Topology, moves: GlobalMoves, evaluate, deadline: float | None,
                 limit: int | None, plans: dict[str, Strategy], results: dict[str, SimResult],
                 stats: ChainStats, started: float, pace: Pace | None = None) -> list[tuple[Strategy, SimResult]]:
    """``sweep`` with ``evaluate``'s lowering cache and the scored baselines (``plans``,
    ``results``) known; each timed plan considered in ``stats``; the timed plans with their
    results by ``mcmc.rank`` (those that fit first, then the fastest), the chains' starts, the
    best remembered last (``Evaluator`` keeps the most recent)."""
    known = {plans[name]: results[name] for name in results if name in plans}
    # the Evaluator's reduce dtype None (each plan its own): the estimate reduces in the compute dtype
    done = sweep(graph, topo, moves, evaluate.optimizer, evaluate.precision, evaluate, evaluate.lowering_cache,
                 deadline, limit, known, pace, evaluate.reduce_dtype or "compute")
    timed = [s for s in done if s.result is not None]
    for s in timed:
        consider(stats, s.plan, s.result, plan_cost(s.result), started)
    timed.sort(key=lambda s: rank(s.result.fits, plan_cost(s.result)))  # stable: the sweep's order on ties
    for s in reversed(timed):
        evaluate.remember(s.plan, s.result)  # a chain starting from it does not simulate it again
    return [(s.plan, s.result) for s in timed]
