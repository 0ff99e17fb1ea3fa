"""The global move: one proposal that changes how the devices are factored, data × tensor ×
pipeline degrees with the micro-batches and schedule, the sharding level, recompute and the
layout between the blocks, and re-derives every op's config from it as the baselines do
(``strategies.megatron.megatron``: ``tp``, ``pp``, ``microbatches``, ``sequence_parallel``, and
``virtual_stages`` 2 under the interleaved schedule;
``strategies.baselines.sharded`` for the sharding level; recompute is Megatron-LM's full recompute of every
transformer layer, ``strategies.megatron_layers.layer_recomputed``, each layer keeping its input
alone, or of every block, ``strategies.baselines.recomputed``, where the blocks do not pair into
layers). The pipeline degree divides the transformer layers (``pipeline_degrees``; at most the
blocks where they do not pair): every stage holds the same whole layers, as Megatron-LM's layers
divide by its pipeline size, and a stage of the ops between two blocks alone would only add a
hop. The micro-batch counts are the search's ``choices`` and, for each data-parallel degree d,
one sequence a micro-batch (batch / d, the count Megatron-LM runs), so the family of
``strategies.baselines.megatron_lm`` (tensor × pipeline with sequence parallelism, 1F1B, one
sequence a micro-batch, layers recomputed, ZeRO-1) is among the factorizations. A proposal draws one
factorization uniformly, whatever the current plan, so the reverse of a move from one
factorization's plan to another's is a move of the same probability (on plans that are not a
factorization's, the op moves' ground, the chain is a search, not an exact sampler).

With probability ``RESTAGE``, where the current plan has pipeline stages (not interleaved), the proposal is
instead the plan with its stages rebalanced by the simulator's per-unit compute times, read
off the search's lowering of the plan (``stagemove.restage``, ``stagemove.op_seconds``:
PipeDream's dynamic program; no simulation). With probability ``RESYNC``, where the plan has
micro-batches, ops on disjoint device sets and an op on several devices, it is the plan with its gradient
buckets synced after the backward instead of during it, or back (``overlap_grad_reduce``); a
drawn factorization keeps the current plan's sync.

``mcmc.run_chain`` makes it with probability ``SearchConfig.global_move`` of the proposals other
than sharding-level, recompute and micro-batch moves; ``init="factorized"`` starts a chain from
a factorization drawn with its seed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from soapsearch.search.stagemove import op_seconds, restage, stage_units
from strategies.baselines import recomputed, sharded
from strategies.config import ZERO_LEVELS
from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.megatron import megatron, megatron_blocks
from strategies.megatron_layers import layer_ops, layer_recomputed
from strategies.pieces import check_microbatches
from strategies.strategy import SCHEDULES, Strategy

if TYPE_CHECKING:
    from soapsearch.search.api import Evaluator

__all__ = ["RESTAGE", "Factorization", "GlobalMoves", "divisors", "layers_of", "pipeline_degrees", "stages_fit"]

RESTAGE = 0.25
"""The probability that a global proposal from a pipelined plan rebalances its stages."""
RESYNC = 0.1
"""The probability that a global proposal from a plan with micro-batches, ops on disjoint device
sets and an op on several devices (``_piped_replicas``) is the plan with its gradient sync turned
(``Strategy.overlap_grad_reduce``): its own reverse."""


@dataclass(frozen=True)
class Factorization:
    """Data × ``tp`` × ``pp`` devices, ``microbatches`` under ``schedule`` (``interleaved``: 2
    chunks per pipeline rank, ``microbatches`` a multiple of ``pp``, its 2·``pp`` stages fitting
    the layers: ``stages_fit``), the weighted ops at sharding level ``zero``, every transformer
    layer recomputed or not (its blocks' ops where the blocks do not pair into layers), the ops
    between the blocks cut on the sequence (``sequence_parallel``) or the samples."""

    tp: int
    pp: int
    microbatches: int
    schedule: str
    zero: int
    recompute: bool
    sequence_parallel: bool


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def stages_fit(stages: int, blocks: int, layers: int | None) -> bool:
    """Whether ``stages`` pipeline stages each take the same whole transformer layers: the
    ``layers`` divide by them (Megatron-LM asserts num_layers % (pp · virtual stages) == 0; a
    stage without a layer would be pure overhead: its send, receive and bubble with no work), or,
    where the ``blocks`` do not pair into layers (``layers`` None), there are at most the blocks."""
    return layers % stages == 0 if layers is not None else stages <= max(blocks, 1)


def pipeline_degrees(num_devices: int, blocks: int, layers: int | None) -> list[int]:
    """The pipeline degrees a search factors ``num_devices`` devices into: the divisors whose
    stages fit the layers (``stages_fit``)."""
    return [p for p in divisors(num_devices) if stages_fit(p, blocks, layers)]


def _counts(graph: OpGraph, choices: Sequence[int], d: int, apart: dict[int, bool]) -> list[int]:
    """``choices`` and one sequence a micro-batch on ``d`` data-parallel replicas (batch / d,
    where it divides and keeps every op's samples apart), sorted; ``apart``: each count's
    check, made once (``check_microbatches`` once per op shape)."""
    batch = graph.batch_size or 0
    one = batch // d if batch and batch % d == 0 else None
    if one is not None and one not in choices:
        if one not in apart:
            try:
                check_microbatches(graph, one)
                apart[one] = True
            except PlanError:
                apart[one] = False
        one = one if apart[one] else None
    return sorted({*choices, *((one,) if one else ())})


def layers_of(graph: OpGraph) -> list[set[str]] | None:
    """The ops of each transformer layer (``layer_ops``); None where the blocks do not pair."""
    try:
        return layer_ops(graph)
    except PlanError:
        return None


def _piped_replicas(plan: Strategy) -> bool:
    """Whether ``plan`` has micro-batches, ops on disjoint device sets (pipeline stages: sends
    between them) and an op on several devices: where syncing the gradient buckets after the
    backward and its sends can differ from overlapping them (``strategies.overlap``)."""
    if plan.microbatches < 2:
        return False
    sets = list({frozenset(devices) for devices in {c.devices for _, c in plan.configs}})  # each device list once
    return any(len(a) > 1 for a in sets) and any(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[:i])


def _tied(graph: OpGraph) -> bool:
    """A weight read by two ops (GPT's tied embedding and head): on two pipeline stages its
    level-2/3 shard would be read through no partition on some replicas, which
    ``strategies.zero.gather_uses`` refuses, so pipelined factorizations keep levels 0 and 1."""
    names = [w.name for node in graph for w in node.weights]
    return len(names) != len(set(names))


class GlobalMoves:
    """The factorizations of one graph on ``num_devices`` devices (micro-batches of
    ``choices`` and one sequence a micro-batch, ``_counts``; sharding levels 2 and 3 on one stage
    only where a weight is tied, ``_tied``), each one's plan made when first drawn and kept;
    ``evaluate``: the search's ``Evaluator``, whose topology, cost model and lowering cache give
    the restage its op times (None: no restage)."""

    def __init__(self, graph: OpGraph, num_devices: int, choices: Sequence[int], precision: str,
                 evaluate: "Evaluator | None" = None):
        self.graph, self.num_devices, self.precision, self.evaluate = graph, num_devices, precision, evaluate
        blocks = len(megatron_blocks(graph))
        tps = [t for t in divisors(num_devices) if t <= 8] if blocks else [1]
        self.layers = layers_of(graph) if blocks else None
        count = len(self.layers) if self.layers is not None else None
        pps = pipeline_degrees(num_devices, blocks, count)
        tied = _tied(graph)
        apart: dict[int, bool] = {}  # micro-batch count -> whether it keeps every op's samples apart
        self.factorizations = [
            Factorization(t, p, m, s, z, r, sp)
            for t in tps for p in pps if t * p <= num_devices
            for m in _counts(graph, choices, num_devices // (t * p), apart)
            for s in ((*SCHEDULES, *(("interleaved",) if p > 1 and m % p == 0 and stages_fit(2 * p, blocks, count)
                                      else ())) if m > 1 else ("gpipe",))
            for z in (ZERO_LEVELS if p == 1 or not tied else tuple(z for z in ZERO_LEVELS if z < 2))
            for r in ((False, True) if blocks else (False,)) for sp in ((False, True) if t > 1 else (False,))]
        self._base: dict[tuple, Strategy | None] = {}
        self._made: dict[Factorization, Strategy | None] = {}

    def __bool__(self) -> bool:
        return self.num_devices > 1 and len(self.factorizations) > 1

    def plan(self, f: Factorization) -> Strategy | None:
        """The plan of ``f`` (None where the graph does not take it: a PlanError of the baseline)."""
        if f not in self._made:
            v = 2 if f.schedule == "interleaved" else 1  # 2 model chunks per pipeline rank
            key = (f.tp, f.pp, f.microbatches, f.sequence_parallel, v)
            if key not in self._base:
                try:
                    self._base[key] = megatron(self.graph, self.num_devices, f.tp, f.pp, f.microbatches,
                                               f.sequence_parallel, v)
                except PlanError:
                    self._base[key] = None
            plan = self._base[key]
            if plan is not None:
                plan = plan.with_microbatches(f.microbatches, f.schedule)
                plan = sharded(plan, self.graph, f.zero) if f.zero else plan
                if f.recompute:
                    plan = (recomputed(plan, self.graph) if self.layers is None
                            else layer_recomputed(plan, self.graph, self.layers))
                plan = self.evaluate.planned(plan) if self.evaluate is not None else plan.with_precision(self.precision)
            self._made[f] = plan
        return self._made[f]

    @functools.cached_property
    def units(self) -> list[list[str]]:
        """``stagemove.stage_units`` of the graph (the units a restage moves between stages),
        made when first read."""
        return stage_units(self.graph)

    def op_seconds(self, plan: Strategy) -> dict[str, float]:
        """``stagemove.op_seconds`` of ``plan`` in the search's precision, from its lowering cache,
        trimmed after it as after a simulation (``LoweringCache.trim``: the stage moves and the
        chains' start lower between the Evaluator's calls, past its bound otherwise)."""
        ev = self.evaluate
        seconds = op_seconds(self.graph, ev.planned(plan), ev.topology, ev.cost, ev.lowering_cache)
        ev.lowering_cache.trim()
        return seconds

    def draw(self, rng: random.Random) -> Strategy | None:
        """The plan of a factorization drawn uniformly (None where the graph does not take it)."""
        return self.plan(rng.choice(self.factorizations))

    def propose(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """A drawn factorization's plan, or (``RESTAGE``) ``current`` restaged, or (``RESYNC``)
        ``current`` with its gradient sync turned; None where it is ``current`` or not valid."""
        if self.evaluate is not None and current.schedule != "interleaved" and rng.random() < RESTAGE:
            return restage(self.graph, current, self.op_seconds, self.units)
        if _piped_replicas(current) and rng.random() < RESYNC:
            return current.with_overlap_grad_reduce(not current.overlap_grad_reduce)
        plan = self.draw(rng)
        if plan is not None and plan.overlap_grad_reduce != current.overlap_grad_reduce:
            plan = plan.with_overlap_grad_reduce(current.overlap_grad_reduce)  # the chain's sync kept
        return None if plan is None or plan == current else plan
