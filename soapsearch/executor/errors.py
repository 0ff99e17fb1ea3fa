"""Why a plan cannot run here, said before any work starts (docs/design.md, "Executor")."""

from __future__ import annotations

from soapsearch.trace import check_scalar_loss
from strategies.lowering import Lowered
from strategies.rules import OPAQUE, get_rule
from strategies.rules.opaque import OpaqueCall
from strategies.schedule import warmup

__all__ = ["ExecutorError", "check_runnable"]


class ExecutorError(RuntimeError):
    """A plan the executor cannot run, or a run that failed, naming the rank and the op."""


def check_runnable(lowered: Lowered, world_size: int) -> None:
    """Raise ExecutorError unless every rank can run ``lowered`` with ``world_size`` ranks:
    one rank per device, every opaque op with the call it runs, one scalar loss output, and no reduction whose devices
    disagree on the 1F1B warm-up (their collectives would wait on each other)."""
    strategy, graph = lowered.strategy, lowered.graph
    lowered.check_whole("the executor")  # copy 0's lowering (strategies.lowering_copies): PlanError
    if world_size != strategy.num_devices:
        raise ExecutorError(
            f"the plan is for {strategy.num_devices} devices but WORLD_SIZE is {world_size}: "
            f"start exactly {strategy.num_devices} processes (torchrun --nproc-per-node "
            f"{strategy.num_devices}, or nnodes x nproc-per-node = {strategy.num_devices})")
    uncallable = [n for n in graph if get_rule(n.kind).kind == OPAQUE
                  and not isinstance(n.attrs.get("call"), OpaqueCall)]
    if uncallable:
        what = ", ".join(f"{n.name!r} ({n.attrs.get('target', n.kind)})" for n in uncallable[:5])
        raise ExecutorError(
            f"{len(uncallable)} opaque op(s) have no rule and no recorded call to run: {what}; "
            "trace the model with soapsearch.trace, which records what the model called")
    check_scalar_loss(graph, ExecutorError)
    _check_recompute(lowered)
    if strategy.microbatches > 1:
        cache: dict[int, int] = {}
        for red in lowered.reductions:
            w = {d: cache.setdefault(d, warmup(lowered, d)) if d not in cache else cache[d]
                 for d in red.devices}
            if len(set(w.values())) > 1:
                raise ExecutorError(
                    f"op {red.op!r}: its {red.name} reduction spans devices {list(red.devices)} "
                    f"whose {strategy.schedule} warm-ups differ ({w}): their all-reduces would wait "
                    "on each other; use schedule 'gpipe' or keep the op's devices in one stage")
        for s in lowered.weight_shards:
            if s.zero < 2:
                continue
            w = {d: cache.setdefault(d, warmup(lowered, d)) if d not in cache else cache[d] for d in s.devices}
            if len(set(w.values())) > 1:
                raise ExecutorError(
                    f"op {s.ops[0]!r}: zero = {s.zero}: weight {s.name!r} is held by devices {list(s.devices)} whose "
                    f"{strategy.schedule} warm-ups differ ({w}): its per-use collectives would wait on each other; use "
                    "schedule 'gpipe' or keep the weight's readers in one stage")


def _check_recompute(lowered: Lowered) -> None:
    """Recompute re-runs a partition's forward: refused where that forward does more than
    compute (docs/design.md, "Recompute"): a sum across devices (its collective would run
    again on some ranks only) or a batchnorm's running statistics (updated twice)."""
    for name, pieces in lowered.pieces.items():
        if not pieces.recompute:
            continue
        node = lowered.graph[name]
        if pieces.reductions:
            red = pieces.reductions[0]
            raise ExecutorError(
                f"op {name!r}: recompute = True: its partitions sum {red.name} across devices "
                f"{list(red.devices)} in their forward, and the executor does not run that collective "
                "again in a recomputation; keep the op (recompute false) or hold it on one device")
        if node.kind == "batchnorm2d" and node.attrs.get("training"):
            raise ExecutorError(
                f"op {name!r}: recompute = True: a training batchnorm updates its running statistics "
                "in its forward, which a recomputation would do twice; keep the op (recompute false)")
