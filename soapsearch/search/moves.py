"""The moves beside an op's cut: the sharding level of weighted ops, recompute, and the plan's
micro-batches (issue 21: memory is a searched resource).

- **Sharding level** (``ParallelConfig.zero``, ZeRO 0-3): one op, one op in every instance of a
  repeated block (a linear of every layer), one Megatron-shaped block's ops
  (``strategies.megatron.megatron_blocks``) or every weighted op at once given one random
  level other than the first op's. Only ops with a trainable weight whose shards have two
  replicas or more under the current plan (``strategies.replicas.shardable``) take it; where
  none of the chosen ops does, the proposal is skipped (a level on a shard held by one device
  changes nothing).
- **Recompute** (``ParallelConfig.recompute``): one op, one op in every instance of a repeated
  block (Korthikanti et al. 2022's selective recompute: the same ops of every layer), one block
  (their full recompute of a layer's block) or every op, turned on, or off where all of them
  have it.
  Input, parameter and constant ops compute nothing kept for backward and never take it.
- **Micro-batches**: the plan with another count of ``choices`` or another schedule (GPipe or
  1F1B, where it has more than one micro-batch). Every op's config must stay valid with the
  new count (``validate_config``); where one does not, the proposal is rejected before it is
  simulated. The op moves that follow draw from the
  candidates of the plan's own count (``space``).

- **Repeated block** (``repeatmove.py``): op i of every instance of a repeated block (a
  transformer's layers) set to one config, or one instance's configs copied to all.

Moves that change an op's degrees or devices (``mcmc``'s op and group moves, ``blockmove``)
keep its sharding level and recompute (``keep``). ``mcmc.run_chain`` makes each kind with its
probability (``MoveRates``: ``SearchConfig.zero_move``, ``recompute_move``,
``microbatch_move``; of the other proposals ``global_move`` and ``repeat_move``) and accepts it
by the same Metropolis rule as an op move.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from soapsearch.search.blockmove import BlockMoves
from soapsearch.search.candidates import Candidates, ConfigSpace
from soapsearch.search.globalmove import GlobalMoves
from soapsearch.search.repeatmove import RepeatMoves
from soapsearch.search.subgraph import SubgraphMoves
from strategies.config import ZERO_LEVELS, ParallelConfig, validate_config
from strategies.drops import recomputable
from strategies.errors import PlanError
from strategies.graph import OpGraph
from strategies.lowered import WEIGHT_KINDS
from strategies.megatron import flattened_relaid, megatron_blocks
from strategies.pieces import check_microbatches
from strategies.replicas import shardable
from strategies.strategy import SCHEDULES, Strategy

__all__ = ["MoveRates", "Moves", "Space", "candidate_configs", "keep", "microbatch_choices", "neighbor_ops"]

SCOPES = (("op", 0.35), ("repeated", 0.15), ("block", 0.3), ("all", 0.2))
"""How many ops a sharding-level or recompute move sets, with its probability: one op; one op
of a repeated block in every instance (``repeatmove.py``'s op i of every layer; one op where the
op is in none, or the search makes no repeated-block moves); one block's ops (one op where the
graph has no block); every op it applies to."""


def keep(old: ParallelConfig, new: ParallelConfig) -> ParallelConfig:
    """``new``'s cut with ``old``'s sharding level and recompute (a degree or device move)."""
    if (new.zero, new.recompute) == (old.zero, old.recompute):
        return new
    return new.with_memory(old.zero, old.recompute)


@dataclass(frozen=True)
class MoveRates:
    """The probability that a proposal is each kind of move (the rest are op and block moves)."""

    zero: float = 0.0
    recompute: float = 0.0
    microbatches: float = 0.0
    repeat: float = 0.0
    """Of the other proposals, a repeated-block move (``repeatmove.py``), where the graph has
    repeated blocks."""
    factorization: float = 0.0
    """Of the other proposals, a global move (``globalmove.py``), where ``Moves.globals`` is set."""
    subgraph: float = 0.0
    """A connected set of ops onto one device set (``subgraph.py``)."""

    @classmethod
    def of(cls, config, factorization: bool = True) -> "MoveRates":
        """The rates a ``SearchConfig`` sets (``factorization=False``: no global moves, as the
        study's trials, whose device count is drawn, make none)."""
        return cls(zero=config.zero_move, recompute=config.recompute_move, microbatches=config.microbatch_move,
                   repeat=config.repeat_move, factorization=config.global_move if factorization else 0.0,
                   subgraph=config.subgraph_move)


@dataclass
class Space:
    """What op moves draw from for one count of micro-batches: every op's valid configs
    (``candidates``), the ops with a choice (``ops``), the configs per (op, devices) for group
    moves (``on_devices``), each op's configs as a set for subgraph moves (``config_set``), the
    group moves' neighbours and the block moves. Each is made when a move first reads it."""

    candidates: Mapping[str, list[ParallelConfig]]
    neighbors: dict[str, tuple[str, ...]] | None = None
    blocks: BlockMoves | None = None
    _ops: list[str] | None = field(init=False, default=None, repr=False)
    _by_devices: dict[int, dict[tuple[int, ...], list[ParallelConfig]]] = field(init=False, repr=False)
    """By the identity of an op's list of configs: its configs per device tuple."""
    _sets: dict[int, frozenset[ParallelConfig]] = field(init=False, repr=False)
    """By the identity of an op's list of configs: them as a set."""

    def __post_init__(self) -> None:
        self._by_devices, self._sets = {}, {}

    @property
    def ops(self) -> list[str]:
        """The ops with more than one config, in graph order."""
        if self._ops is None:
            self._ops = [op for op, cfgs in self.candidates.items() if len(cfgs) > 1]
        return self._ops

    def on_devices(self, op: str, devices: tuple[int, ...]) -> list[ParallelConfig]:
        """``op``'s configs on exactly ``devices``, indexed per op when a group move first asks,
        so a space of millions of configs (a 175B model on 1,024 devices) costs nothing up front;
        ops that share one list of configs (``candidates.ConfigSpace``) share its index."""
        cfgs = self.candidates.get(op, ())
        index = self._by_devices.get(id(cfgs))
        if index is None:
            index = self._by_devices[id(cfgs)] = {}
            for c in cfgs:
                index.setdefault(c.devices, []).append(c)
        return index.get(devices, [])

    def config_set(self, op: str) -> frozenset[ParallelConfig]:
        """``op``'s configs as a set, made when a move first asks and shared by the ops that
        share one list of configs (``candidates.ConfigSpace``)."""
        cfgs = self.candidates.get(op, ())
        got = self._sets.get(id(cfgs))
        if got is None:
            got = self._sets[id(cfgs)] = frozenset(cfgs)
        return got


def candidate_configs(graph: OpGraph, num_devices: int, microbatches: int,
                      node_size: int | None, space: ConfigSpace | None = None) -> Candidates:
    """Every valid config of every op (``strategies.config.enumerate_configs``' order), each
    (degrees, devices) pair one shared ParallelConfig and each op's list made when first read,
    shared by the ops of its signature (``candidates.ConfigSpace``; ``space``: one shared with
    other counts of micro-batches), so GPT-3 175B's 2,123 ops on 1,024 devices enumerate 21 lists,
    not 2,123, and only those a move reads."""
    return (space or ConfigSpace(graph, num_devices, node_size)).at(microbatches)


def neighbor_ops(graph: OpGraph, candidates: dict[str, list[ParallelConfig]]) -> dict[str, tuple[str, ...]]:
    """Op -> its producers and consumers that have a choice of config (the group moves')."""
    return {node.name: tuple(n for n in dict.fromkeys((*node.inputs, *graph.users(node.name)))
                             if len(candidates.get(n, ())) > 1)
            for node in graph}


def microbatch_choices(graph: OpGraph, counts: Sequence[int], own: int) -> tuple[int, ...]:
    """The counts of ``counts`` (and ``own``) that divide the batch and keep every op's samples
    apart (``check_microbatches``), sorted."""
    batch = graph.batch_size
    out = {own}
    for m in counts:
        if batch and batch % m == 0:
            try:
                check_microbatches(graph, m)
            except PlanError:
                continue
            out.add(m)
    return tuple(sorted(out))


class Moves:
    """The sharding-level, recompute and micro-batch moves of one graph on ``num_devices``
    devices, and the op moves' ``Space`` per count of micro-batches (made when first needed)."""

    def __init__(self, graph: OpGraph, num_devices: int, rates: MoveRates = MoveRates(),
                 choices: Sequence[int] = (1,), node_size: int | None = None,
                 spaces: dict[int, Space] | None = None, repeat_stages: bool = False,
                 configs: ConfigSpace | None = None):
        self.graph, self.num_devices, self.rates, self.node_size = graph, num_devices, rates, node_size
        self.configs = configs or ConfigSpace(graph, num_devices, node_size)
        """Every count's configs, one list per op signature (``spaces`` given: the one they were made in)."""
        self.choices = tuple(choices)
        self.spaces: dict[int, Space] = dict(spaces or {})
        self.weighted = [n.name for n in graph if any(w.trainable for w in n.weights)]
        self.computing = [n.name for n in graph if recomputable(graph, n)]
        self.blocks = [(*cols, *mid, row) for cols, mid, row in megatron_blocks(graph)] if num_devices > 1 else []
        self._replicated: dict[tuple[str, tuple[int, ...]], bool] = {}
        self._subgraphs: dict[int, SubgraphMoves] = {}
        self.repeats = RepeatMoves(graph, num_devices, repeat_stages) if rates.repeat else None
        self.globals: GlobalMoves | None = None
        """The global moves (``globalmove.GlobalMoves``), set by the search that has them."""
        self.symmetric = None
        """``symmove.SymmetricMoves`` where proposals keep the current plan's copies (set by the
        search from ``FOLD_FROM`` devices): ``mcmc.run_chain`` wraps its proposals with it."""

    def repeated(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with op i of every instance of a repeated block set alike
        (``repeatmove.RepeatMoves``); None where the graph has no repeated block."""
        if not self.repeats:
            return None
        return self.repeats.propose(current, self.space(current.microbatches).candidates, rng)

    def space(self, m: int) -> Space:
        if m not in self.spaces:
            candidates = candidate_configs(self.graph, self.num_devices, m, self.node_size, self.configs)
            self.spaces[m] = Space(candidates, neighbor_ops(self.graph, candidates),
                                   BlockMoves(self.graph, self.num_devices, m) or None)
        return self.spaces[m]

    def _scope(self, ops: list[str], rng: random.Random) -> list[str]:
        """One op, one op of ``ops`` in every instance of its repeated block, one block's ops
        of ``ops`` or all of ``ops`` (``SCOPES``)."""
        u, scope = rng.random(), "all"
        for name, p in SCOPES:
            if u < p:
                scope = name
                break
            u -= p
        if scope == "block" and self.blocks:
            within = set(ops)
            picked = [op for op in rng.choice(self.blocks) if op in within]
            if picked:
                return picked
            scope = "op"
        if scope == "all":
            return list(ops)
        op = rng.choice(ops)
        if scope == "repeated" and self.repeats:
            for block in self.repeats.blocks:
                at = block.position(op)
                if at is not None:  # op i of every instance, those of ``ops``
                    within = set(ops)
                    return [inst[at[1]] for inst in block.instances if inst[at[1]] in within]
        return [op]

    def _shardable(self, current: Strategy, op: str) -> bool:
        """``strategies.replicas.shardable``, kept per (op, degrees) for an op that reads its own
        weights (its replicas follow from its degrees alone)."""
        if self.graph[op].kind in WEIGHT_KINDS:
            return shardable(self.graph, current, op)
        key = (op, current[op].degrees)
        if key not in self._replicated:
            self._replicated[key] = shardable(self.graph, current, op)
        return self._replicated[key]

    def zero(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with a new sharding level on one op, one op of every instance, one
        block's weighted ops or every weighted op (``_scope``; those whose shards have two
        replicas or more); None where none has."""
        if not self.weighted:
            return None
        ops = [op for op in self._scope(self.weighted, rng) if self._shardable(current, op)]
        if not ops:
            return None
        level = rng.choice([z for z in ZERO_LEVELS if z != current[ops[0]].zero])
        return _set(current, ops, lambda cfg: cfg.with_memory(zero=level))

    def recompute(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with recompute turned on for one op, one op of every instance, one
        block's ops or every op that computes (``_scope``; off where each of them has it
        already)."""
        if not self.computing:
            return None
        ops = self._scope(self.computing, rng)
        on = not all(current[op].recompute for op in ops)
        return _set(current, ops, lambda cfg: cfg.with_memory(recompute=on))

    def subgraph(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with a connected set of ops on one device set (``subgraph.py``), drawn
        from the space of the plan's own count of micro-batches."""
        m = current.microbatches
        if m not in self._subgraphs:
            here = self.space(m)
            self._subgraphs[m] = SubgraphMoves(self.graph, self.num_devices, here,
                                               here.neighbors or neighbor_ops(self.graph, here.candidates),
                                               self.node_size)
        return self._subgraphs[m].propose(current, rng)

    def microbatches(self, current: Strategy, rng: random.Random) -> Strategy | None:
        """``current`` with another (micro-batches, schedule) pair: a count of ``choices`` and,
        where it is more than one, GPipe or 1F1B (one micro-batch keeps the plan's schedule,
        which then orders nothing); None where there is no other pair or an op's config is not
        valid with the count. At another count the ops a flatten reads row block by row block
        (the targets) are re-cut as it reads them (``megatron.flattened_relaid``)."""
        pairs = [(m, s) for m in self.choices for s in (SCHEDULES if m > 1 else (current.schedule,))
                 if (m, s) != (current.microbatches, current.schedule if m > 1 else s)]
        if not pairs:
            return None
        m, schedule = rng.choice(pairs)
        if m == current.microbatches:
            return current.with_microbatches(m, schedule)
        plan = flattened_relaid(self.graph, current.with_microbatches(m, schedule))
        try:
            for node in self.graph:
                validate_config(node, plan[node.name], self.num_devices, m)
        except PlanError:
            return None
        return plan


def _set(current: Strategy, ops: list[str], change) -> Strategy | None:
    """``current`` with ``change`` applied to each of ``ops``' configs; None where nothing
    changes."""
    plan = current
    for op in ops:
        cfg = change(current[op])
        if cfg != current[op]:
            plan = plan.replace(op, cfg)
    return None if plan is current else plan
