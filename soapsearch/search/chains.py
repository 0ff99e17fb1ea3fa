"""The MCMC chains of one search, run one after another or side by side in forked worker
processes, one per core. Each chain draws from its own random stream (``chain_rng``) and starts
from a copy of the same scored baselines, so no chain depends on another: the same seed and
proposal budget give the same plan with any number of workers. The merged result keeps the
best plan by ``mcmc.consider``'s rule, the first chain winning ties."""

from __future__ import annotations

import copy
import gc
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from simulator.result import SimResult
from soapsearch.search.blockmove import BlockMoves
from soapsearch.search.mcmc import REPLICAS, Budget, ChainStats, rank, run_chain
from soapsearch.search.moves import Moves
from soapsearch.search.pace import Pace
from strategies.config import ParallelConfig
from strategies.strategy import Strategy

__all__ = ["Chain", "Progress", "chain_rng", "default_workers", "run_chains"]

POLL_S = 0.1
"""How often the parent reports the workers' progress."""


class Progress(NamedTuple):
    """What a search's ``on_step`` sees: proposals and acceptances over all chains so far, and
    the least of the chains' best plans' ms."""

    proposals: int
    accepted: int
    best_ms: float


@dataclass(frozen=True)
class Chain:
    start: Strategy
    seed: int
    budget: Budget


def chain_rng(seed: int, index: int) -> random.Random:
    """Chain ``index``'s own stream for a search seeded ``seed`` (independent of the others)."""
    return random.Random(seed * 1_000_003 + index)


def default_workers(chains: int, measures: bool) -> int:
    """One worker per chain up to the cores this process may use; one where the cost model
    times kernels on the machine it runs on (two chains timing at once would time each other) or where
    processes cannot be forked."""
    if measures or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(chains, cores))


def run_chains(chains: list[Chain], evaluate: Callable[[Strategy], SimResult],
               candidates: dict[str, list[ParallelConfig]], base: ChainStats, started: float, *,
               beta: float | None, reset_every: int, workers: int,
               on_step: Callable[[Progress], None] | None = None,
               neighbors: dict[str, tuple[str, ...]] | None = None,
               blocks: BlockMoves | None = None, moves: Moves | None = None,
               replicas: int = REPLICAS, patience: int | None = None,
               pace: Pace | None = None) -> tuple[ChainStats, bool]:
    """Every chain from a copy of ``base`` (the scored baselines), ``workers`` at a time; the
    merged stats (``merge``) and whether Ctrl-C stopped the search. ``workers`` > 1 forks; a
    chain's error is raised here as it was raised there. ``neighbors``, ``blocks``, ``moves``,
    ``replicas``, ``patience`` and ``pace`` (the chains time their steps into it, a forked
    chain into its own copy):
    ``mcmc.run_chain``'s."""
    if workers < 1:
        raise ValueError(f"search workers = {workers}: must be >= 1")
    if workers > 1 and len(chains) > 1:
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError(f"search workers = {workers}: this platform cannot fork worker processes; "
                             "use workers=1")
        results, interrupted = _forked(chains, evaluate, candidates, base, started, beta, reset_every,
                                       workers, on_step, neighbors, blocks, moves,
                                       replicas, patience, pace)
    else:
        results, interrupted = _in_turn(chains, evaluate, candidates, base, started, beta, reset_every,
                                        on_step, neighbors, blocks, moves, replicas, patience, pace)
    return merge(base, results), interrupted


def _in_turn(chains, evaluate, candidates, base, started, beta, reset_every, on_step, neighbors, blocks, moves,
             replicas, patience, pace):
    rows = _rows([0.0] * (_FIELDS * len(chains)), base)
    results: list[ChainStats] = []
    for i, chain in enumerate(chains):
        stats = _fresh(base)
        write = _writer(rows, i, base)

        def step(stats: ChainStats, _cost: float) -> None:
            write(stats)
            if on_step is not None:
                on_step(_progress(rows, base))

        try:
            run_chain(chain.start, evaluate, candidates, chain.budget, chain_rng(chain.seed, i),
                      beta, reset_every, stats, started, on_step=step, neighbors=neighbors, blocks=blocks,
                      moves=moves, replicas=replicas, patience=patience, pace=pace)
        except KeyboardInterrupt:
            results.append(stats)
            return results, True
        results.append(stats)
    return results, False


_FIELDS = 3
"""Per chain in the progress rows: proposals, acceptances, the best plan's ms."""


def _rows(rows, base: ChainStats):
    """``rows`` (a list, or shared memory for forked chains) set to no proposal yet, each chain
    at ``base``'s best."""
    for i in range(0, len(rows), _FIELDS):
        rows[i:i + _FIELDS] = [0.0, 0.0, _best_ms(base)]
    return rows


def _writer(rows, i: int, base: ChainStats) -> Callable[[ChainStats], None]:
    """Writes chain ``i``'s stats (beyond ``base``'s) into its row."""
    at = _FIELDS * i

    def write(stats: ChainStats) -> None:
        rows[at:at + _FIELDS] = [stats.proposals - base.proposals, stats.accepted - base.accepted,
                                 _best_ms(stats)]
    return write


def _progress(rows, base: ChainStats) -> Progress:
    """The rows summed: proposals and acceptances, and the least best ms."""
    return Progress(int(sum(rows[0::_FIELDS])), int(sum(rows[1::_FIELDS])),
                    min([_best_ms(base), *rows[2::_FIELDS]]))


def _forked(chains, evaluate, candidates, base, started, beta, reset_every, workers, on_step, neighbors, blocks,
            moves, replicas, patience, pace):
    ctx = multiprocessing.get_context("fork")
    shared = _rows(ctx.RawArray("d", _FIELDS * len(chains)), base)
    stop = ctx.RawValue("b", 0)
    results: list[ChainStats | None] = [None] * len(chains)
    pending = list(range(len(chains)))
    running: dict[Any, tuple[int, Any]] = {}  # connection -> (chain index, process), from before its start
    interrupts = 0
    errors: list[BaseException] = []
    try:
        while running or (pending and not stop.value):
            try:
                while pending and len(running) < workers and not stop.value:
                    i = pending.pop(0)
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_worker, daemon=True,
                                       args=(send, i, chains[i], evaluate, candidates, base, started, beta,
                                             reset_every, shared, stop, neighbors, blocks, moves, replicas,
                                             patience, pace))
                    running[recv] = (i, proc)
                    try:
                        proc.start()
                    finally:
                        send.close()  # the parent's end: a worker that dies leaves EOF, not a hang
                for conn in multiprocessing.connection.wait(list(running), timeout=POLL_S):
                    i, proc = running[conn]
                    try:
                        kind, payload = conn.recv()
                    except EOFError:
                        kind, payload = "lost", None
                    del running[conn]
                    _close(conn, proc)
                    if kind == "ok":
                        results[i] = payload
                    elif kind == "error":
                        errors.append(payload)
                        stop.value = 1
                    elif not interrupts:  # a worker killed under Ctrl-C has nothing to say
                        errors.append(RuntimeError(f"chain {i}'s worker exited with code {proc.exitcode} "
                                                   "and no result"))
                        stop.value = 1
                if on_step is not None:
                    on_step(_progress(shared, base))
            except KeyboardInterrupt:
                interrupts += 1
                stop.value = 1  # the workers ignore SIGINT and stop at their next proposal
                if interrupts > 1:  # a second Ctrl-C: no more waiting
                    break
    finally:
        stop.value = 1
        for conn, (_, proc) in running.items():
            _close(conn, proc, terminate=interrupts > 1)
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], interrupts > 0


def _close(conn, proc, terminate: bool = False) -> None:
    """The pipe closed and the process reaped (terminated if asked or if it does not stop)."""
    conn.close()
    if proc.pid is None:  # never started
        return
    if terminate:
        proc.terminate()
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join()


def _worker(conn, i, chain, evaluate, candidates, base, started, beta, reset_every, shared, stop,
            neighbors, blocks, moves, replicas, patience, pace) -> None:
    """A forked chain: runs until its budget or the parent's stop flag, then sends its stats."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides: it raises the stop flag
    gc.disable()  # it exits after its chain: a cyclic collection would walk the search's caches first
    write = _writer(shared, i, base)
    try:
        stats = _fresh(base)
        run_chain(chain.start, evaluate, candidates, chain.budget, chain_rng(chain.seed, i), beta,
                  reset_every, stats, started, should_stop=lambda: bool(stop.value),
                  on_step=lambda s, _cost: write(s), neighbors=neighbors, blocks=blocks, moves=moves,
                  replicas=replicas, patience=patience, pace=pace)
        write(stats)
        conn.send(("ok", stats))
    except BaseException as e:  # noqa: BLE001 - raised again in the parent, as with one worker
        try:
            conn.send(("error", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            conn.send(("error", RuntimeError(f"chain {i}: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
    finally:
        conn.close()


def _fresh(base: ChainStats) -> ChainStats:
    """A chain's own stats, starting from ``base``'s (its plans shared: a lowering cache knows
    an unchanged config by its identity)."""
    out = copy.copy(base)
    out.history, out.ranks = list(base.history), list(base.ranks)
    return out


def _best_ms(stats: ChainStats) -> float:
    return stats.best_result.iteration_ms if stats.best_result is not None else math.inf


def merge(base: ChainStats, results: list[ChainStats]) -> ChainStats:
    """One ChainStats for the search: ``base`` plus every chain's proposals and acceptances,
    the best plan by ``consider``'s rule (fits first, then cost; the earlier chain on a tie)
    and the improvements of all chains in time order, each kept where it beats, by that rule,
    every one before it."""
    out = _fresh(base)
    events = []
    for stats in results:
        out.proposals += stats.proposals - base.proposals
        out.accepted += stats.accepted - base.accepted
        out.scored += stats.scored - base.scored
        out.block_accepted += stats.block_accepted - base.block_accepted
        out.stopped_early += stats.stopped_early - base.stopped_early
        events += zip(stats.history[len(base.history):], stats.ranks[len(base.ranks):])
        if stats.best_result is not None and (
                out.best_result is None
                or rank(stats.best_result.fits, stats.best_cost) < rank(out.best_result.fits, out.best_cost)):
            out.best, out.best_cost, out.best_result = stats.best, stats.best_cost, stats.best_result
    best = min((rank(fits, cost) for fits, cost in out.ranks), default=None)
    for entry, (fits, cost) in sorted(events, key=lambda e: e[0][0]):
        if best is None or rank(fits, cost) < best:
            out.history.append(entry)
            out.ranks.append((fits, cost))
            best = rank(fits, cost)
    return out
