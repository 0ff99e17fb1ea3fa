"""A gradient bucket's collective starts after the backward step that makes it final on each
member (``strategies.overlap``) and overlaps the rest of the backward: zoo mlp data parallel on
2 devices with its first linear at sharding level 1 (``first1_dp``: two buckets on the same
devices). The level-0 bucket's pack waits on layers_2's backward and runs before layers_1's,
its all-reduce starts before layers_0's backward ends, and the iteration is shorter than with
every bucket started after the last backward step, on slow links (k80 PCIe) and fast (P100
NVLink) alike."""

from __future__ import annotations

import pytest

import simulator.tasks as tasks
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from strategies.lowering import lower
from strategies.overlap import BucketIssue, bucket_issues, bucket_order, bucket_plan
from strategies.schedule import Step
from tests.conftest import traced
from tests.executor.plans import make_plan


def _plan():
    g = traced("mlp")
    return g, make_plan(g, "first1_dp", 2)


def test_issue_points_are_the_rule():
    g, plan = _plan()
    low = lower(g, plan)
    level0, level1 = bucket_order(low)
    assert (level0.zero, level1.zero) == (0, 1)
    assert bucket_issues(low) == {d: [BucketIssue(level0, Step(True, "layers_2", d, 0)),
                                      BucketIssue(level1, Step(True, "layers_0", d, 0))] for d in (0, 1)}


def test_the_bucket_waits_on_its_ops_backward_only():
    g, plan = _plan()
    tg = build_tasks(lower(g, plan), get_topology("k80-16x4"), get_cost_model("analytical"))
    src, dst = tg.edge_arrays()
    for d in (0, 1):
        [pack] = [t for t in range(len(tg)) if tg.label(t) == f"pack allreduce bucket 0-1 device {d}"]
        before = {tg.label(int(s)) for s in src[dst == pack]}
        after = {tg.label(int(t)) for t in dst[src == pack]}
        assert before == {f"bwd layers_2[{d}]@mb0"}, before
        assert f"bwd layers_1[{d}]@mb0" in after  # the device's next step waits on it


def _step_end(lowered, *memos):
    """``bucket_plan`` with every bucket started after the device's last weighted backward step
    (no overlap)."""
    order, issues = bucket_plan(lowered, *memos)
    return order, {d: [BucketIssue(i.key, steps[-1].after) for i in steps] for d, steps in issues.items()}


@pytest.mark.parametrize("topology", ["k80-16x4", "p100-4x4"])
def test_overlap_shortens_the_iteration(monkeypatch, topology):
    g, plan = _plan()
    got = simulate_plan(g, plan, topology, timeline=True)
    times = {(name, d): (s, e) for name, d, _, s, e, _ in got.timeline}
    allreduce = next(v for (name, _), v in times.items() if name == "allreduce bucket 0-1")
    reduce_scatter = next(v for (name, _), v in times.items() if name == "reducescatter bucket 0-1 zero1")
    last = times[("bwd layers_0[0]@mb0", 0)]
    assert allreduce[0] < last[0]  # started before the last weighted backward step
    assert reduce_scatter[0] >= last[1]
    monkeypatch.setattr(tasks, "bucket_plan", _step_end)
    serial = simulate_plan(g, plan, topology).iteration_time
    assert got.iteration_time < serial
