import random

import pytest

from simulator.engine import run_events
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from simulator.cost import AnalyticalCostModel
from strategies import ParallelConfig, Strategy, enumerate_configs, pipeline
from strategies.lowering import lower
from strategies.schedule import device_order, stages, warmup
from tests.conftest import traced
from tests.strategies.test_lowering import random_plan


def test_gpipe_runs_every_forward_before_any_backward():
    g = traced("mlp")
    lowered = lower(g, pipeline(g, 2, microbatches=4))
    for steps in device_order(lowered).values():
        kinds = [s.backward for s in steps]
        assert kinds == sorted(kinds)
        fwd_mbs = [s.microbatch for s in steps if not s.backward]
        assert fwd_mbs == sorted(fwd_mbs)


def test_1f1b_warms_up_by_stage():
    g = traced("gpt", batch_size=8)
    lowered = lower(g, pipeline(g, 4, microbatches=8, schedule="1f1b"))
    runs = stages(lowered)
    assert len(runs) == 4
    assert [warmup(lowered, d) for d in range(4)] == [4, 3, 2, 1]
    last = device_order(lowered)[3]
    first_bwd = next(i for i, s in enumerate(last) if s.backward)
    assert {s.microbatch for s in last[:first_bwd]} == {0}  # last stage: F0 then B0


def test_devices_exchanging_both_ways_share_one_warmup():
    g = traced("mlp")  # ops alternate between devices 0 and 1: data flows both ways
    cfgs = {n.name: ParallelConfig((1,) * len(n.dims), (i % 2,)) for i, n in enumerate(g)}
    lowered = lower(g, Strategy.of(cfgs, 2, microbatches=4, schedule="1f1b"))
    assert [warmup(lowered, d) for d in range(2)] == [1, 1]
    run_events(build_tasks(lowered, get_topology("p100-1x2"), AnalyticalCostModel()))


def test_a_split_stage_between_two_pipeline_stages_does_not_deadlock():
    """Ops on device 0, then a stage cut over devices 0 and 1, then device 1 (found by the
    optuna study): devices 0 and 1 exchange both ways inside the middle stage."""
    g = traced("alexnet", batch_size=8)
    names = [n.name for n in g]
    mid = {"features_6", "features_7", "features_8"}
    cfgs = {}
    for i, n in enumerate(g):
        if n.name in mid:
            cfgs[n.name] = ParallelConfig(tuple(2 if k == 1 else 1 for k in range(len(n.dims))), (0, 1))
        else:
            cfgs[n.name] = ParallelConfig((1,) * len(n.dims), (0 if i < names.index("features_6") else 1,))
    lowered = lower(g, Strategy.of(cfgs, 2, microbatches=4, schedule="1f1b"))
    assert [warmup(lowered, d) for d in range(2)] == [1, 1]
    run_events(build_tasks(lowered, get_topology("p100-1x2"), AnalyticalCostModel()))


def test_random_pipelines_with_split_stages_never_deadlock():
    g = traced("alexnet", batch_size=8)
    rng = random.Random(0)
    topo = get_topology("p100-1x4")
    for _ in range(40):
        cut = sorted(rng.sample(range(1, len(g)), 3))
        cfgs = {}
        for i, n in enumerate(g):
            stage = sum(i >= c for c in cut)
            choices = [c for c in enumerate_configs(n, 4, 4) if min(c.devices) >= stage - 1
                       and max(c.devices) <= stage]
            cfgs[n.name] = rng.choice(choices or [ParallelConfig((1,) * len(n.dims), (stage,))])
        lowered = lower(g, Strategy.of(cfgs, 4, microbatches=4, schedule="1f1b"))
        run_events(build_tasks(lowered, topo, AnalyticalCostModel()))


@pytest.mark.parametrize("name", ["alexnet", "gpt", "nmt", "inception_v3"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_random_plans_never_deadlock(name, schedule):
    g = traced(name)
    topo = get_topology("p100-1x4")
    for seed in range(6):
        plan = random_plan(g, 4, seed, microbatches=2).with_microbatches(2, schedule)
        lowered = lower(g, plan)
        order = device_order(lowered)
        assert sum(len(v) for v in order.values()) == 2 * sum(
            len(parts) for per_mb in lowered.partitions.values() for parts in per_mb)
        run_events(build_tasks(lowered, topo, AnalyticalCostModel()))  # raises on a cycle


def test_members_of_a_level_3_shard_share_one_warmup():
    """Device 1 feeds device 0 only (it would warm up 2 forwards, device 0 one), but both hold
    layers_0's weight at level 3, whose per-use all-gathers they call together: one group."""
    g = traced("mlp")
    cfgs = {n.name: ParallelConfig((1,) * len(n.dims), (0,)) for n in g}
    cfgs["inputs"] = ParallelConfig((1, 1), (1,))
    cfgs["targets"] = ParallelConfig((1,), (1,))
    cfgs["layers_0"] = ParallelConfig((2, 1, 1), (0, 1), zero=3)
    lowered = lower(g, Strategy.of(cfgs, 2, microbatches=2, schedule="1f1b"))
    assert [warmup(lowered, d) for d in range(2)] == [1, 1]
    tasks = build_tasks(lowered, get_topology("p100-1x2"), AnalyticalCostModel())
    run_events(tasks)  # a cycle (the gathers called in two orders) raises
