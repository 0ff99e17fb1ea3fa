"""One check that delta simulation (the search's Evaluator) scores a plan exactly as a
simulation from scratch, shared by the tests of moves that change several ops at once."""

from strategies.baselines import sharded
from strategies.errors import PlanError
from strategies.lowering import lower
from simulator.simulate import simulate_plan


def drawn_move(rng, current, graph, spaces: dict, weighted, cuts: tuple[float, ...], levels: tuple[int, ...]):
    """One move of a walk from plan ``current`` and its kind, drawn by one ``rng.random()``
    against ``cuts``, the upper bounds of a micro-batch count (1 or 2, either schedule), a
    whole-plan level (0-3), an FSDP unit change, a bucket cap and one weighted op's level
    (``weighted``); past them a drawn op's drawn config (``spaces``: by micro-batch count) with
    a level from ``levels`` where the op holds trainable weights."""
    u = rng.random()
    if u < cuts[0]:
        return current.with_microbatches(rng.choice((1, 2)), rng.choice(("gpipe", "1f1b"))), "count"
    if u < cuts[1]:
        return sharded(current, graph, rng.choice((0, 1, 2, 3))), "level"
    if u < cuts[2]:
        return current.with_fsdp_unit("op" if current.fsdp_unit == "block" else "block"), "unit"
    if u < cuts[3]:
        return current.with_bucket_cap(rng.choice((0.001, 0.01, 25.0))), "bucket"
    if u < cuts[4]:
        op = rng.choice(weighted)
        return current.replace(op, current[op].with_memory(zero=rng.choice((0, 1, 2, 3)))), "op"
    candidates = spaces[current.microbatches]
    op = rng.choice([op for op, cfgs in candidates.items() if len(cfgs) > 1])
    cfg = rng.choice(candidates[op])
    return current.replace(op, cfg.with_memory(zero=rng.choice(levels) if any(
        w.trainable for w in graph[op].weights) else 0)), "op"


def assert_same_result(got, want, context=None) -> None:
    """Two simulations' figures agree to the bit (``context`` names the case on failure)."""
    assert (got.iteration_time, got.peak_memory_bytes, got.busy_time, got.bytes_moved,
            got.num_tasks) == (want.iteration_time, want.peak_memory_bytes, want.busy_time,
                               want.bytes_moved, want.num_tasks), context


def assert_delta_equals_full(evaluate, plan, context=None) -> None:
    delta = evaluate(plan, summary=True)
    full = simulate_plan(evaluate.graph, evaluate.planned(plan), evaluate.topology, evaluate.cost,
                         optimizer=evaluate.optimizer, summary=True)
    assert_same_result(delta, full, context)


def checked_lowering(evaluate, plan, context=None):
    """None where ``plan`` is refused (PlanError); else, delta = full asserted on it, the
    search's lowering of it (``evaluate.lowering_cache``: the ops shared with the last plan's)."""
    try:
        lower(evaluate.graph, plan)
    except PlanError:
        return None
    assert_delta_equals_full(evaluate, plan, context)
    return lower(evaluate.graph, plan, evaluate.lowering_cache)
