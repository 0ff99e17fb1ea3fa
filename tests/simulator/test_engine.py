"""The event engine on hand-made task graphs: list scheduling in order of readiness, a device's
compute stream free from its last task's end, links backfilled (a transfer takes the earliest gap
that all the links of its route have free)."""

import pytest

from simulator.engine import run_events
from simulator.tasks import TaskGraph, TaskKind

# Two devices' compute streams (0, 1) and four link directions: 2 = A's NIC out, 3 = B's NIC in,
# 4 = C's NIC out, 5 = A's NIC in (resource ids: devices first, then links).
OUT_A, IN_B, OUT_C, IN_A = 2, 3, 4, 5


def graph(tasks, edges=()):
    """tasks: (duration, resources); edges: (before, after) task indices."""
    tg = TaskGraph(num_devices=2, num_links=4)
    for i, (duration, res) in enumerate(tasks):
        tg.add(f"t{i}", TaskKind.TRANSFER, duration, res, 0)
    for a, b in edges:
        tg.edge(a, b)
    return tg


def test_a_transfer_blocked_at_its_destination_leaves_its_source_link_to_the_next():
    # t0 holds B's NIC in 0..10. t1 (A -> B, ready 1) waits for it: 10..13 on A's NIC out and
    # B's NIC in. t2 (A -> A's own NIC in, say, ready 2) needs only A's NIC out, idle 0..10:
    # the old rule (A's NIC out free from 13) started it at 13; backfilling starts it at 2.
    tg = graph([(10.0, (IN_B,)), (3.0, (OUT_A, IN_B)), (4.0, (OUT_A, IN_A)),
                (1.0, (0,)), (2.0, (1,))],
               edges=[(3, 1), (4, 2)])
    start, end = run_events(tg)
    assert start[:3] == [0.0, 10.0, 2.0]
    assert end[:3] == [10.0, 13.0, 6.0]


def test_a_gap_too_short_is_skipped_and_the_next_one_taken():
    # A's NIC out is busy 0..4 (t0) and 5..9 (t2, which waits for B's NIC in, busy 0..5 with t1):
    # its gaps are 4..5 and from 9 on. t3 (2 long, ready 3) does not fit 4..5 and starts at 9;
    # t4 (1 long, ready 3) fits 4..5 exactly.
    tg = graph([(4.0, (OUT_A,)), (5.0, (IN_B,)), (4.0, (OUT_A, IN_B)), (2.0, (OUT_A,)),
                (1.0, (OUT_A,)), (3.0, (0,))],
               edges=[(5, 3), (5, 4)])
    start, end = run_events(tg)
    assert start[:5] == [0.0, 0.0, 5.0, 9.0, 4.0]
    assert end[:5] == [4.0, 5.0, 9.0, 11.0, 5.0]


def test_a_gap_must_be_free_on_every_link_of_the_route():
    # A's NIC out is busy 0..2 (t2) and 6..8 (t4, waiting for B's NIC in until 6), C's NIC out
    # 3..5 (t3, waiting for A's NIC in until 3). t5 (2 long, ready 1) needs both: 2..4 is free on
    # A but not on C, 5..7 on C but not on A; it starts at 8.
    tg = graph([(6.0, (IN_B,)), (3.0, (IN_A,)), (2.0, (OUT_A,)), (2.0, (OUT_C, IN_A)),
                (2.0, (OUT_A, IN_B)), (2.0, (OUT_A, OUT_C)), (1.0, (0,))],
               edges=[(6, 5)])
    start, end = run_events(tg)
    assert start == [0.0, 0.0, 0.0, 3.0, 6.0, 8.0, 0.0]
    assert end == [6.0, 3.0, 2.0, 5.0, 8.0, 10.0, 1.0]


def test_a_compute_stream_runs_its_tasks_in_order_of_readiness():
    # Device 0: t0 0..5; t2 is ready at 1 (after t3) and t1 at 2 (after t4): t2 runs 5..6, then
    # t1 6..8. (A device's gaps open only before a task's ready time, which no task placed after
    # it can use: its free time is the backfilling rule.)
    tg = graph([(5.0, (0,)), (2.0, (0,)), (1.0, (0,)), (1.0, (1,)), (1.0, (1,))],
               edges=[(3, 2), (3, 4), (4, 1)])
    start, end = run_events(tg)
    assert start == [0.0, 6.0, 5.0, 0.0, 1.0]
    assert end == [5.0, 8.0, 6.0, 1.0, 2.0]


def test_back_to_back_transfers_and_a_cycle():
    tg = graph([(1.0, (OUT_A, IN_B))] * 3)
    start, end = run_events(tg)
    assert (start, end) == ([0.0, 1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(RuntimeError, match="cycle: 2 tasks never became ready"):
        run_events(graph([(1.0, (0,)), (1.0, (0,))], edges=[(0, 1), (1, 0)]))
