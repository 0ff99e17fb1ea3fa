"""ZeRO-3 prefetch (``strategies.prefetch``, FSDP2's one unit ahead): where each level-3
all-gather is issued, and what the simulator charges for it. Delta simulation with prefetch
equals full simulation: ``test_zero_sim.test_delta_equals_full_with_levels`` (level 3 cases)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import simulator.zero3 as zero3
from simulator.cost import get_cost_model
from simulator.engine import run_events
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from simulator.taskgraph import label
from strategies import data_parallel
from strategies.lowering import lower
from strategies.prefetch import _ahead, _ahead_own, _second_key, calls_at, issue_positions, issued_at, own_positions
from tests.conftest import traced
from tests.executor.plans import zero


def test_issue_points_by_hand():
    """Steps 1, 2, 4 and 5 gather: 1 at its own start, 2 at 1's, 4 at 2's, 5 at 4's; the
    others gather nothing (their own position)."""
    gathers = [False, True, True, False, True, True]
    assert issue_positions(gathers) == [0, 1, 1, 3, 2, 4]
    assert issued_at(gathers) == [[], [1, 2], [4], [], [5], []]
    assert issued_at([False, False]) == [[], []]


def test_bytes_ahead_of_own_units_are_the_calls_walk():
    """Every step its own unit (``fsdp_unit`` "op"): the prefetched bytes alive at each
    position (``_ahead_own``, each step's gathers from its issue position to it) equal the
    walk over the calls (``_ahead`` of ``calls_at``), on random reading orders of 0-3 gathers
    a step."""
    rng = random.Random(3)
    for _ in range(300):
        each = tuple(tuple((q, (rng.randrange(1, 1 << 20), ("g", rng.randrange(3))))
                           for _ in range(rng.choice((0, 0, 1, 2, 3)))) for q in range(rng.randrange(1, 12)))
        gathers = np.array([bool(g) for g in each])
        nbytes = np.array([sum(u[0] for _, u in g) for g in each], dtype=np.int64)
        assert _ahead_own(gathers, nbytes).tolist() == _ahead(calls_at(each, None, _second_key)), each


def test_own_positions_are_the_units_walk():
    """Every step its own unit: ``own_positions`` (numpy) equals ``issue_positions``' walk over
    units, each step a unit of its own (None), on random run orders."""
    rng = random.Random(5)
    for _ in range(300):
        gathers = [rng.random() < 0.4 for _ in range(rng.randrange(0, 15))]
        walk = issue_positions(gathers, [None] * len(gathers))
        assert own_positions(np.array(gathers, dtype=bool)).tolist() == issue_positions(gathers) == walk, gathers


def _times(low):
    tg = build_tasks(low, get_topology("p100-2x2"), get_cost_model("analytical"))
    start, end = run_events(tg, native=False)
    return tg, list(map(label, tg.name)), start, end


def test_prefetched_gathers_hide_behind_the_previous_unit(monkeypatch):
    """zoo mlp (three linears, each its weight and bias one group), data parallel on 2 devices,
    level 3. Without prefetch (each gather issued at its reader's step) all six all-gathers are
    on the critical path; with it each one but the first forward one is issued at the start of
    the previous gathering step and lasts less (~2 µs) than that step's compute (≥ 5 µs), so
    the iteration is shorter by exactly their durations, and each such gather starts where the
    previous gathering step starts."""
    g = traced("mlp")
    low = lower(g, zero(3, data_parallel(g, 2), g))
    tg, names, start, end = _times(low)
    with monkeypatch.context() as m:
        m.setattr(zero3, "issue_positions", lambda gathers, units=None: list(range(len(gathers))))
        _, names0, _, end0 = _times(low)
    assert names0 == names
    gathers = [i for i, x in enumerate(names) if x.startswith("allgather ")]
    assert len(gathers) == 6
    hidden = [i for i in gathers if not names[i].startswith("allgather fwd layers.0.")]
    assert len(hidden) == 5
    assert max(end0) - max(end) == pytest.approx(sum(tg.duration[i] for i in hidden), rel=1e-9, abs=0)
    step = {x: i for i, x in enumerate(names) if x.startswith(("fwd ", "bwd "))}
    for phase, op, before in (("fwd", "layers_2", ("fwd", "layers_0")), ("fwd", "layers_4", ("fwd", "layers_2")),
                              ("bwd", "layers_4", ("fwd", "layers_4")), ("bwd", "layers_2", ("bwd", "layers_4")),
                              ("bwd", "layers_0", ("bwd", "layers_2"))):
        ag = next(i for i in gathers if names[i].startswith(f"allgather {phase} ") and f" {op}@mb0" in names[i])
        prev = step[f"{before[0]} {before[1]}[0]@mb0"]
        assert start[ag] == pytest.approx(start[prev], rel=1e-12)
        assert end[ag] < end[prev]  # hidden: done before the step it was issued at ends
