"""A step-end collective's overhead scales with how many of its members arrive together
(``simulator.stragglers``): the expected max of k normal jitters, e(k), over e(m)."""

import math

import pytest

from simulator.devices import DeviceSpec, Link
from simulator.simulate import simulate_plan
from simulator.stragglers import expected_max, straggler_durations, together
from simulator.taskgraph import TaskGraph, TaskKind
from simulator.topology import Topology
from strategies import ParallelConfig, Strategy, data_parallel
from tests.simulator.test_tasks import MS, Fixed, classifier, pair, regression


def test_expected_max_of_k_standard_normals_and_between():
    assert together(1.0) == 0.0 and together(3.0) == expected_max(3)
    assert together(2.25) == pytest.approx(0.75 * expected_max(2) + 0.25 * expected_max(3))
    assert expected_max(1) == 0.0
    assert expected_max(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert expected_max(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-9)
    assert expected_max(4) == pytest.approx(1.0293753730, abs=1e-9)
    with pytest.raises(ValueError, match="k = 0"):
        expected_max(0)


def two_stages():
    """regression() with y and the loss on device 1: device 0 ends its backward at 8.1 ms,
    device 1 at 4.8 ms; the loss value's all-reduce runs 8.1-12.3 (test_tasks)."""
    g = regression()
    on1 = {"y", "mse_loss"}
    return g, Strategy.of({n.name: ParallelConfig((1,) * len(n.dims), (int(n.name in on1),)) for n in g}, 2)


@pytest.mark.parametrize("overhead_ms, iteration_ms", [(0.0, 12.3), (0.5, 12.3), (2.0, 12.3),
                                                       (4.0, 12.3 + 4.0 * (1 - 3.3 / 4.0)), (33.0, 12.3 + 33.0 * 0.9)])
def test_a_collective_one_member_arrives_at_alone_costs_no_overhead(overhead_ms, iteration_ms):
    # device 1 arrives 3.3 ms before device 0: it counts 1 - 3.3 / w of a member, w the overhead
    # (k = 1 + that, e(k) / e(2) = that fraction of the overhead after the all-reduce); with
    # w <= 3.3 ms device 0 arrives alone (k = 1: none)
    g, plan = two_stages()
    r = simulate_plan(g, plan, pair(200e3, collective_overhead=overhead_ms * MS), Fixed())
    assert r.iteration_ms == pytest.approx(iteration_ms, rel=1e-9)


def test_data_parallel_members_arrive_together_and_pay_the_whole_overhead():
    # test_tasks' classifier: the bucket's host work 8.18-8.58 on each device, step end 9.98
    g = classifier()
    assert simulate_plan(g, data_parallel(g, 2), pair(200e3, collective_overhead=0.4 * MS),
                         Fixed()).iteration_ms == pytest.approx(9.98, rel=1e-9)


def test_two_of_four_arriving_together_pay_e2_over_e4():
    # four devices compute 10, 9.5, 3 and 1 ms, then one collective; 2 ms of overhead: the
    # second counts 1 - 0.5 / 2 of a member, the others none: k = 1.75 of m = 4
    dev = DeviceSpec("t", 1 << 30, {"float32": 1e12}, 1e11, collective_overhead=2 * MS)
    pairs = [(a, b) for a in range(4) for b in range(4) if a != b]
    topo = Topology("four", (dev,) * 4, tuple(Link(f"l{a}->{b}", "t", 1e-6, 1e9) for a, b in pairs),
                    {p: (i,) for i, p in enumerate(pairs)})
    tg = TaskGraph(4, 0)
    work = [tg.add(f"work {d}", TaskKind.FORWARD, ms * MS, (d,), d) for d, ms in enumerate((10, 9.5, 3, 1))]
    c = tg.add("collective", TaskKind.ALLREDUCE, 1 * MS, (), 0)
    hosts = tuple(tg.add(f"host {d}", TaskKind.ALLREDUCE, 2 * MS, (d,), d) for d in range(4))
    for w in work:
        tg.edge(w, c)
    for h in hosts:
        tg.edge(c, h)
    tg.syncs.append((c, tuple(enumerate(hosts)), tuple(enumerate(work)), 1))
    end = [10 * MS, 9.5 * MS, 3 * MS, 1 * MS, 11 * MS] + [13 * MS] * 4
    duration = straggler_durations(tg, topo, end)
    assert list(duration[:5]) == pytest.approx([10 * MS, 9.5 * MS, 3 * MS, 1 * MS, 1 * MS])
    assert list(duration[5:]) == pytest.approx([2 * MS * 0.75 * expected_max(2) / expected_max(4)] * 4)
    tg.syncs[:] = [(c, tuple(enumerate(hosts)), ((0, work[0]), (2, work[2]), (3, work[3])), 1)]  # 1 not arriving
    assert list(straggler_durations(tg, topo, end)[5:]) == pytest.approx([0.0] * 4)
    end[1] = end[2] = end[3] = 10 * MS  # all four at once: the whole overhead, nothing to re-run
    tg.syncs[:] = [(c, tuple(enumerate(hosts)), tuple(enumerate(work)), 1)]
    assert straggler_durations(tg, topo, end) is None
