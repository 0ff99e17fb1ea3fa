"""Delta simulation equals full on a 50-step walk of mixed moves (one op's config, one op's
recompute flag, a run of consecutive ops set at once, the micro-batch count), folded and not:
AlexNet on a100-1x8 from data parallel at 2 micro-batches under 1F1B (folded: the walk
accepts only proposals that fold, so it stays on replicated plans and proposals step off
them), the iteration time, every device's busy time, peak memory and bytes moved per link kind of the
search's path (one lowering cache, one ``TaskCache``) against a per-device simulation from
scratch."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import TaskCache
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.errors import PlanError
from strategies.lowering import lower
from tests.conftest import traced


def _move(graph, plan, dp, candidates: dict, rng: random.Random):
    """One mixed move of ``plan`` (see the module docstring; ``dp``: data parallel's plan)."""
    kind = rng.choice(("op", "op", "recompute", "run", "microbatches"))
    names = [node.name for node in graph]
    if kind == "microbatches":
        return plan.with_microbatches(3 - plan.microbatches, plan.schedule)  # 1 <-> 2
    if kind == "recompute":
        op = rng.choice([n for n in names if graph.needs_grad[n] and graph[n].kind not in ("input", "parameter")])
        return plan.replace(op, plan[op].with_memory(recompute=not plan[op].recompute))
    at = rng.randrange(len(names))
    back = rng.random() < 0.5  # the run back to data parallel's configs (a replicated plan again)
    for op in names[at:at + (3 if kind == "run" else 1)]:
        cfg = dp[op] if back else rng.choice(candidates[op])
        plan = plan.replace(op, cfg.with_memory(recompute=plan[op].recompute))
    return plan


@pytest.mark.parametrize("fold", [pytest.param(True, marks=pytest.mark.slow), False])  # folded: the longer case
def test_delta_equals_full_on_a_walk_of_mixed_moves(fold):
    graph = traced("alexnet", batch_size=16)
    topo, cost = get_topology("a100-1x8"), get_cost_model("analytical")
    candidates = {op: [c for c in cfgs if c.degrees[0] % 2 == 0 or len(c.devices) == 1]  # 2 micro-batches cut
                  for op, cfgs in candidate_configs(graph, 8, 2, topo.node_size).items()}
    lowering, tasks = {}, TaskCache(topo, cost)
    rng = random.Random(11)
    dp = data_parallel(graph, 8)
    plan = dp.with_microbatches(2, "1f1b")
    steps = folded = 0
    while steps < 50:
        proposal = _move(graph, plan, dp, candidates, rng)
        try:
            lower(graph, proposal)
        except PlanError:
            continue
        steps += 1
        got = simulate_plan(graph, proposal, topo, cost, cache=tasks, lowering_cache=lowering, fold=fold)
        want = simulate_plan(graph, proposal, topo, cost, fold=False)
        assert got.iteration_time == pytest.approx(want.iteration_time, rel=1e-12, abs=0), steps
        assert got.busy_time == pytest.approx(want.busy_time, rel=1e-12, abs=1e-18), steps
        assert (got.peak_memory_bytes, got.bytes_moved) == (want.peak_memory_bytes, want.bytes_moved), steps
        if not fold:
            assert (got.iteration_time, got.busy_time) == (want.iteration_time, want.busy_time)  # to the bit
        folds = got.num_tasks < want.num_tasks
        folded += folds
        if rng.random() < 0.6 and (folds or not fold):  # folded: the walk keeps to replicated plans
            plan = proposal
    assert (folded > 10) == fold
