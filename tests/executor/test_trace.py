"""The executor records its per-step Chrome events only when asked (``trace``): a long run
without a trace keeps no per-step state. A gloo world of one process, in this process."""

from __future__ import annotations

import pytest

from soapsearch.executor import Executor, build_model
from strategies.baselines import data_parallel


@pytest.mark.parametrize("trace", [False, True])
def test_events_are_recorded_only_with_trace(world_of_one, trace):
    built = build_model("mlp", "tiny")
    ex = Executor(built.graph, data_parallel(built.graph, 1), built.state, built.inputs,
                  trace=trace)
    losses = [ex.step(seed=s) for s in range(3)]
    step_end = ["gradient sync", "loss", "update", "loss"]
    assert len(ex.events) == (3 * (len(ex.steps) + len(step_end)) if trace else 0)
    if trace:
        assert {e["ph"] for e in ex.events} == {"X"} and all(e["dur"] >= 0 for e in ex.events)
        assert [e["name"] for e in ex.events[:2]] == [ex.steps[0][1].forward_name, ex.steps[1][1].forward_name]
        one = ex.events[:len(ex.steps) + len(step_end)]
        assert [e["cat"] for e in one] == [("backward" if b else "forward") for b, _ in ex.steps] + step_end
        ends = [e["ts"] + e["dur"] for e in one]
        assert all(e["ts"] >= end - 1e-3 for e, end in zip(one[1:], ends))  # one after another
    assert losses[2] < losses[0]  # it trains either way
