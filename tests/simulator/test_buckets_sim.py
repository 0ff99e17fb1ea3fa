"""Gradient buckets cut at the plan's cap (``strategies.lowered.split_buckets``) overlap the
backward, worked out by hand on zoo mlp data parallel over 2 k80 devices: at a 4 KiB cap bucket 0
(layers_2 and layers_4, 5,544 B and the loss sum's 8 B riding it) is packed after layers_2's
backward and all-reduced while layers_1's and layers_0's run; it is done before layers_0's
ends, so only bucket 1 (layers_0, 2,176 B) is all-reduced after the backward. The packs and
unpacks copy the same bytes in all (``copy_time`` is linear), so the iteration is shorter than
with one bucket by exactly allreduce(7,728 B) - allreduce(2,176 B). Delta = full with several
buckets on walks of one-op proposals."""

from __future__ import annotations

import pytest

from simulator.comm import allreduce_time
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from strategies.baselines import data_parallel, sharded
from tests.conftest import traced
from tests.simulator.delta_walk import delta_walk


def _times(result):
    return {name: (s, e) for name, d, _, s, e, _ in result.timeline if d == 0}


def test_a_small_cap_hides_all_but_the_last_bucket_by_hand():
    g, topo = traced("mlp"), get_topology("k80-16x4")
    one = simulate_plan(g, data_parallel(g, 2), topo, timeline=True)
    split = simulate_plan(g, data_parallel(g, 2).with_bucket_cap(4 / 1024), topo, timeline=True)
    a, b = _times(one), _times(split)
    ar = allreduce_time(topo, (0, 1), 7720 + 8)
    assert a["allreduce bucket 0-1"][1] - a["allreduce bucket 0-1"][0] == pytest.approx(ar, rel=1e-12)
    assert b["allreduce bucket 0-1"][0] == b["pack allreduce bucket 0-1 device 0"][1] <= b["bwd layers_1[0]@mb0"][1]
    assert b["allreduce bucket 0-1"][1] < b["bwd layers_0[0]@mb0"][1]  # hidden behind the backward
    last = allreduce_time(topo, (0, 1), 2176)
    assert b["allreduce bucket 0-1 #1"][1] - b["allreduce bucket 0-1 #1"][0] == pytest.approx(last, rel=1e-12)
    assert one.iteration_time - split.iteration_time == pytest.approx(ar - last, rel=1e-9)
    assert ar - last > 0.4e-6


@pytest.mark.parametrize("name,topology", [("gpt", "p100-2x2"), ("mlp", "local-cpu-4")])
def test_delta_equals_full_with_several_buckets(name, topology):
    graph = traced(name, batch_size=16)

    def start(n):
        plan = data_parallel(graph, n).with_bucket_cap(1 / 1024)
        return sharded(plan, graph, 1) if name == "gpt" else plan
    walked = delta_walk(graph, topology, start, (0, 1), seed=7)
    assert sum(len(low.gradient_sync.buckets) > 2 for low in walked) >= 5
