"""The memory walk's rows patched from the last plan's (``simulator.memory_rows.piece_rows``)
equal the rows built afresh from every op's pieces, on a walk of one-op proposals lowered
through one cache (as the search's Evaluator does), recompute flags toggled in its last third."""

import itertools
import random

import numpy as np
import pytest

from simulator import memory_rows
from simulator import memory_walks
from strategies import data_parallel
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.drops import drop_positions
from tests.conftest import traced
from tests.simulator.test_memory_delta import gpt_walk


def _fresh(low, position):
    """The rows from every op's pieces, no memo read."""
    ops = [low.pieces[name] for name in position]
    n = len(low.device_bytes.kept)
    held = np.fromiter(itertools.chain.from_iterable(p.activations for p in ops), np.int64, len(ops) * n)
    at = [i for i, p in enumerate(ops) if p.dropped]
    return memory_rows.dropped_rows(low, ops, held.reshape(-1, n), at, None,
                                    drop_positions(low.graph, low.strategy, position), position)


def test_patched_rows_equal_fresh_ones_on_a_walk(monkeypatch):
    graph, candidates, ops, position = gpt_walk()
    patched = []
    real = memory_rows._patched

    def counted(last, ops, drops, names, again):
        patched.append(len(again))
        return real(last, ops, drops, names, again)

    monkeypatch.setattr(memory_rows, "_patched", counted)
    monkeypatch.setattr(memory_rows, "PATCH_SHARE", 4)  # gpt's 55 ops: patch up to 13 of them
    rng = random.Random(5)
    current, cache, compared, dropping = data_parallel(graph, 4), {}, 0, 0
    memory_walks._rows(lower(graph, current, cache), collectives=False)
    count = len(patched)
    memory_walks._rows(lower(graph, current), collectives=False)  # every op's pieces new (a full simulation's)
    assert len(patched) == count  # built afresh, not patched op by op
    for step in range(120):
        op = rng.choice(ops)
        recompute = step >= 80 and rng.random() < 0.3  # the last third toggles recompute too
        proposal = current.replace(op, rng.choice(candidates[op]).with_memory(recompute=recompute))
        try:
            low = lower(graph, proposal, cache)
        except PlanError:
            continue
        got = memory_walks._rows(low, collectives=False)
        want = _fresh(low, position)
        for name, g, w in zip(("held", "freed", "redone", "gone"), got, want):
            assert np.array_equal(g, w), (step, op, proposal[op].show(), name)
            with pytest.raises(ValueError):  # shared with the next call's patch: read only
                g[0, 0] += 1
        compared += 1
        dropping += int((want[1] != 0).sum())
        if rng.random() < 0.5:
            current = proposal
    assert compared > 100 and dropping > compared  # every plan frees transient outputs
    assert len(patched) > 60 and sum(1 for k in patched if k) > 40  # most proposals patched some ops


def test_rows_follow_recompute_set_op_by_op():
    """Each proposal sets recompute on one more op (kept): an op's drop entry then reads its
    consumers' entries, so the rows and the drop points are found afresh, never patched."""
    graph = traced("gpt", batch_size=16)
    position = {node.name: i for i, node in enumerate(graph)}
    redo = [n.name for n in graph if graph.needs_grad[n.name] and n.kind not in ("input", "parameter", "constant")]
    rng = random.Random(7)
    current, cache = data_parallel(graph, 4), {}
    for op in rng.sample(redo, 40):
        current = current.replace(op, current[op].with_memory(recompute=True))
        low = lower(graph, current, cache)
        assert memory_walks._drop_positions(graph, current, position) == drop_positions(graph, current, position), op
        for g, w in zip(memory_walks._rows(low, collectives=False), _fresh(low, position)):
            assert np.array_equal(g, w), op
