import pytest

from simulator.engine import run_events
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from simulator.cost import AnalyticalCostModel
from strategies import ParallelConfig, Strategy, pipeline
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


def test_interleaved_placement_falls_back_to_gpipe_order():
    g = traced("mlp")  # ops alternate between devices 0 and 1
    cfgs = {n.name: ParallelConfig((1,) * len(n.dims), (i % 2,)) for i, n in enumerate(g)}
    lowered = lower(g, Strategy.of(cfgs, 2, microbatches=4, schedule="1f1b"))
    assert [warmup(lowered, d) for d in range(2)] == [4, 4]


@pytest.mark.parametrize("name", ["alexnet", "gpt", "nmt", "inception_v3"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_random_plans_never_deadlock(name, schedule):
    g = traced(name)
    topo = get_topology("p100-1x4")
    for seed in range(4):
        plan = random_plan(g, 4, seed, microbatches=2).with_microbatches(2, schedule)
        lowered = lower(g, plan)
        order = device_order(lowered)
        assert sum(len(v) for v in order.values()) == 2 * sum(
            len(parts) for per_mb in lowered.partitions.values() for parts in per_mb)
        run_events(build_tasks(lowered, topo, AnalyticalCostModel()))  # raises on a cycle
