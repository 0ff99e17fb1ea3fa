"""``TaskGraph.arrays``: made once for the graph's tasks (the event loop's passes and the summary
read the same arrays), made again once a task is added."""

import numpy as np

from simulator.taskgraph import Columns, Segment, TaskGraph, TaskKind, join


def test_arrays_are_kept_until_a_task_is_added():
    tg = TaskGraph(2, 1)
    cols = Columns()
    cols.add("a", TaskKind.FORWARD, 1.0, (0,), 0)
    cols.add("b", TaskKind.TRANSFER, 2.0, (0, 2), 0, nbytes=8)
    seg = Segment(cols)
    tg.place([seg], join([(seg.duration, seg.res_len, seg.res)]))
    tg.add("c", TaskKind.FORWARD, 3.0, (1,), 1)
    first = tg.arrays()
    assert tg.arrays() is first  # not joined again
    duration, res_first, res = first
    assert duration.tolist() == [1.0, 2.0, 3.0] and res_first.tolist() == [0, 1, 3, 4] and res.tolist() == [0, 0, 2, 1]
    tg.add("d", TaskKind.UPDATE, 4.0, (), 1)
    duration, res_first, res = tg.arrays()
    assert duration.tolist() == [1.0, 2.0, 3.0, 4.0] and res_first.tolist() == [0, 1, 3, 4, 4]
    assert np.array_equal(res, first[2])
