"""SearchConfig: every knob of a search in one frozen dataclass, the single source of their
defaults. ``search()`` and ``study_search()`` take one; the ``soapsearch search`` CLI builds one
from its flags, whose defaults it reads from the fields here."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from simulator.cost import CostModel
from simulator.memory import OPTIMIZER_STATE
from soapsearch.search.mcmc import Budget, positive, whole
from strategies.strategy import PRECISIONS, REDUCE_DTYPES, SCHEDULES, Strategy

__all__ = ["SearchConfig", "search_config"]


@dataclass(frozen=True)
class SearchConfig:
    """How ``search()`` looks for a plan: its budget, its chains and the plans they start from.
    Every field is checked at construction (``ValueError`` naming the field, its value and the
    rule)."""

    budget_s: float | None = 60.0
    """Seconds of search, split evenly between the rounds of ``workers`` chains (a study:
    between its trials); None: no time limit, stop after ``proposals``."""
    proposals: int | None = None
    """Stop after this many proposals, split between the chains (a study: each trial's);
    None: no limit but the time."""
    cost_model: CostModel | str = "analytical"
    """How long each kernel takes: ``analytical`` (roofline), ``profiled`` (timed and cached)
    or a CostModel."""
    init: tuple[Any, ...] | None = None
    """The chains' initial plans: baseline names, ``random``, ``factorized`` (a factorization's
    plan drawn with the seed, ``globalmove.py``), ``swept`` (the best factorizations, timed
    best-first before the chains: the k-th ``swept`` item the k-th best, ``sweep.py``; the
    search then scores only the baselines of that space, ``sweep.SWEPT_BASELINES``), plan JSON paths or Strategies
    (one item alone is one plan); None: ``hybrid`` (data parallel, or data x tensor parallel
    where a micro-batch does not divide by the devices)."""
    seed: int = 0
    """Seed of every chain's random stream: under a proposal budget the same seed gives the
    same plan with any number of workers."""
    microbatches: int = 1
    """Micro-batches of the chains' plans (pipeline parallelism when > 1)."""
    schedule: str = "gpipe"
    """Pipeline schedule of the chains' plans: ``gpipe`` or ``1f1b``."""
    beta: float | None = None
    """Inverse temperature of the Metropolis acceptance rule min(1, exp(−β·Δcost)), per ms,
    constant, one plan per chain (``replicas`` unused); None: set from a pilot of proposals at
    the start and annealed to greedy by the budget's end, over ``replicas`` tempered plans
    (``mcmc.run_chain``)."""
    replicas: int = 4
    """Plans each chain walks at once at different temperatures, exchanging them (parallel
    tempering); with ``beta`` None."""
    optimizer: str = "sgd"
    """The training optimizer whose state the simulator counts in device memory: ``sgd`` or
    ``adam``."""
    precision: str = "model"
    """The plans' precision (``strategies.strategy.PRECISIONS``): ``model`` computes in the
    model's dtype, ``bf16``/``fp16`` in mixed precision (the simulator's peak, bytes and memory
    follow)."""
    reduce_dtype: str = "compute"
    """What a mixed-precision plan sums its gradients in (``Strategy.reduce_dtype``): every plan
    the search simulates and returns carries it (``Evaluator.planned``)."""
    zero_move: float = 0.05
    """The probability that a proposal sets a sharding level (ZeRO 0-3) of one weighted op, one
    block's or every one's (``moves.Moves.zero``)."""
    recompute_move: float = 0.05
    """The probability that a proposal turns recompute on or off for one op, one block's ops or
    every op (``moves.Moves.recompute``)."""
    microbatch_move: float = 0.02
    """The probability that a proposal gives the plan another count of ``microbatch_choices``
    or pipeline schedule (rejected unless every op's config stays valid with the count;
    ``moves.Moves.microbatches``); 0: the chains keep ``microbatches`` and ``schedule``."""
    repeat_move: float = 0.1
    """The probability that a proposal other than a sharding-level, recompute or micro-batch
    move sets op i of every instance of a repeated block (a transformer's layers,
    ``strategies.repeats``) to one config, or copies one instance's configs to all
    (``repeatmove.RepeatMoves``); drawn only where the graph has repeated blocks."""
    global_move: float = 0.02
    """The probability that a proposal other than a sharding-level, recompute or micro-batch
    move gives every op the config of another factorization of the devices (data × tensor ×
    pipeline degrees, micro-batches, schedule, sharding level, recompute, as the megatron
    baseline derives them) or rebalances the plan's pipeline stages by simulated times
    (``globalmove.GlobalMoves``); 0: none."""
    repeat_stages: bool = False
    """A repeated-block move lets instances on other devices than the one it draws from (other
    pipeline stages) keep their own devices: each takes the config moved onto them."""
    subgraph_move: float = 0.05
    """The probability that a proposal places a connected set of up to ``subgraph.MAX_OPS`` ops
    on one device set of the topology's groups, whole on one device or cut alike on its sample
    dim (``subgraph.SubgraphMoves``); 0: never."""
    microbatch_choices: tuple[int, ...] = (1, 2, 4, 8)
    """The counts a micro-batch move draws from: those the batch divides and every op takes
    (``strategies.pieces.check_microbatches``), and ``microbatches`` itself."""
    num_devices: int | None = None
    """Plan for only the first N devices of the topology; None: all of them."""
    reset_every: int = 500
    """A chain returns to its best plan every this many proposals; 0: never."""
    patience: int | None = None
    """A chain stops early where its best has not improved for this many proposals
    (``SearchResult.stopped_early`` counts those that did); None: for half its proposal
    budget (a time budget alone is spent whole: the annealing turns greedy at its end, where
    late gains come from); 0: never, every chain runs its whole budget. Under a proposal
    budget the stop is deterministic for a seed."""
    chains: int | None = None
    """MCMC chains; None: one per initial plan (chain i starts from ``init[i % len(init)]``)."""
    exhaustive_limit: int = 100_000
    """Where the op configs make at most this many plans (the product of each op's count, at
    ``microbatches``) and no more than ``proposals`` (when given), simulate every one
    (``exhaustive.py``: the exact answer over that space) instead of MCMC; 0: always MCMC."""
    workers: int | None = None
    """Chains run side by side in forked processes; None: one per chain up to the cores, one
    with a cost model that times kernels."""

    def __post_init__(self) -> None:
        init = self.init
        if isinstance(init, (str, os.PathLike, Strategy)):
            init = (init,)
        elif init is not None:
            init = tuple(init)
            if not init:
                raise ValueError("search needs at least one initial plan (init)")
        object.__setattr__(self, "init", init)
        if self.budget_s is not None:  # search() needs one of the two; a study may stop after its trials
            Budget(seconds=self.budget_s)
        if self.proposals is not None:
            Budget(proposals=self.proposals)
        for name, least, optional in (("num_devices", 1, True), ("chains", 1, True), ("workers", 1, True),
                                      ("microbatches", 1, False), ("reset_every", 0, False),
                                      ("exhaustive_limit", 0, False), ("replicas", 1, False),
                                      ("patience", 0, True)):
            _check_whole(name, getattr(self, name), least, optional)
        if not whole(self.seed):
            raise ValueError(f"search seed = {self.seed!r}: must be a whole number")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"search schedule = {self.schedule!r}: must be one of {list(SCHEDULES)}")
        if self.optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"search optimizer = {self.optimizer!r}: must be one of {list(OPTIMIZER_STATE)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"search precision = {self.precision!r}: must be one of {list(PRECISIONS)}")
        if self.reduce_dtype not in REDUCE_DTYPES or (self.reduce_dtype != "compute" and self.precision == "model"):
            raise ValueError(f"search reduce_dtype = {self.reduce_dtype!r}: must be one of {list(REDUCE_DTYPES)}, "
                             "and 'compute' in 'model' precision (a gradient reduce dtype needs bf16 or fp16)")
        rates = {"zero_move": self.zero_move, "recompute_move": self.recompute_move,
                 "microbatch_move": self.microbatch_move, "subgraph_move": self.subgraph_move}
        for name, p in {**rates, "repeat_move": self.repeat_move, "global_move": self.global_move}.items():
            if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1):
                raise ValueError(f"search {name} = {p!r}: a probability is a number in [0, 1]")
        if not isinstance(self.repeat_stages, bool):
            raise ValueError(f"search repeat_stages = {self.repeat_stages!r}: must be True or False")
        if sum(rates.values()) > 1:
            raise ValueError(f"search {' + '.join(rates)} = "
                             f"{' + '.join(f'{p:g}' for p in rates.values())} = {sum(rates.values()):g}: "
                             "the probabilities of a proposal's kinds must sum to at most 1")
        choices = tuple(self.microbatch_choices)
        object.__setattr__(self, "microbatch_choices", choices)
        if not choices or not all(whole(m) and m >= 1 for m in choices):
            raise ValueError(f"search microbatch_choices = {list(choices)!r}: must be whole numbers >= 1")
        if self.beta is not None and not positive(self.beta):
            raise ValueError(f"search beta = {self.beta!r}: must be a finite number > 0 (per ms) or None")


_FIELDS = tuple(f.name for f in dataclasses.fields(SearchConfig))


def _check_whole(name: str, value: Any, least: int, optional: bool) -> None:
    """``value`` is a whole number >= ``least`` (or None where ``optional``)."""
    if value is None and optional:
        return
    if not whole(value) or value < least:
        raise ValueError(f"search {name} = {value!r}: must be a whole number >= {least}")


def search_config(config: SearchConfig | None, changes: Mapping[str, Any], where: str = "search") -> SearchConfig:
    """``config`` (default ``SearchConfig()``) with the fields named in ``changes`` replaced;
    a name that is no field is a TypeError naming it and the fields."""
    base = SearchConfig() if config is None else config
    if not isinstance(base, SearchConfig):
        raise TypeError(f"{where} config = {config!r}: must be a SearchConfig")
    unknown = [k for k in changes if k not in _FIELDS]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}; "
                        f"SearchConfig's fields are {', '.join(_FIELDS)}")
    return dataclasses.replace(base, **changes) if changes else base
