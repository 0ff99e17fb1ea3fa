"""``simulator.collectives.add_collectives`` on a folded lowering (copy 0's, or members 0 and 1
of copy 0's): a member's call steps outside the simulated devices (``keep``) are left out, so
steps named for devices the fold does not simulate give the task graph the steps of the kept
devices alone give, task for task and edge for edge; and ``collective_steps``' steps are
``Step`` records equal to those the constructor makes."""

from __future__ import annotations

import pytest

import simulator.collectives as collectives
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import Lowerings
from strategies.baselines import megatron_lm
from strategies.lowering_members import MemberFold
from strategies.megatron import megatron
from strategies.schedule import Step, collective_steps
from strategies.symmetry import Copies
from tests.conftest import traced
from tests.simulator.test_collective_runs import _graph


def _plans():
    gpt = traced("gpt", "small")
    return [
        pytest.param(megatron_lm(gpt, 16, 4, 2), "a100-2x8", Copies, id="megatron_lm-copies"),
        pytest.param(megatron(gpt, 8, tp=4, pp=2, microbatches=4, virtual_stages=2), "a100-1x8", MemberFold,
                     id="interleaved-members"),
        pytest.param(megatron(gpt, 32, tp=4, pp=2, microbatches=4, sequence_parallel=True, virtual_stages=2),
                     "a100-4x8", MemberFold, id="interleaved-sp-members"),
    ]


@pytest.mark.parametrize("where", ["forward", "backward", "reads"])
@pytest.mark.parametrize("plan,preset,fold", _plans())
def test_steps_of_devices_not_simulated_are_left_out(plan, preset, fold, where, monkeypatch):
    """One more call by a device the fold does not simulate, in each collective's forward or
    backward calls, or one more read there: the task graph of the kept devices alone."""
    graph, topo, cost = traced("gpt", "small"), get_topology(preset), get_cost_model("analytical")
    lowered = Lowerings(graph, plan).first(topo, True, fold is MemberFold)
    assert type(lowered.copies) is fold
    keep = lowered.copies.kept
    outside = next(d for d in range(topo.num_devices) if d not in keep)
    real = collectives.CollectiveSteps
    added = []

    class More(real):
        def __call__(self, c):
            fwd, bwd = super().__call__(c)
            if where == "forward" and fwd:
                fwd = {**fwd, outside: next(iter(fwd.values()))}
                added.append(outside)
            if where == "backward" and bwd:
                bwd = {**bwd, outside: next(iter(bwd.values()))}
                added.append(outside)
            return fwd, bwd

    kept = _graph(lowered, topo, cost, monkeypatch, True)
    with monkeypatch.context() as m:
        if where == "reads":
            readers = {c: (*reads, reads[0]._replace(device=outside))
                       for c, reads in lowered.collective_readers.items()}
            added.append(outside)
            m.setitem(lowered.__dict__, "collective_readers", readers)
        else:
            m.setattr(collectives, "CollectiveSteps", More)
        wider = _graph(lowered, topo, cost, m, True)
    assert added and len(kept[0]) > 0
    for a, b in zip(kept, wider):
        assert a == b


def test_collective_steps_are_step_records():
    graph, topo = traced("gpt", "small"), get_topology("a100-2x8")
    lowered = Lowerings(graph, megatron_lm(graph, 16, 4, 2)).first(topo, True)
    steps = [s for fwd, bwd in collective_steps(lowered) for s in (*fwd.values(), *bwd.values())]
    assert steps and all(type(s) is Step for s in steps)
    assert all(s.microbatch == c.microbatch for c, (fwd, bwd) in zip(lowered.collectives, collective_steps(lowered))
               for s in (*fwd.values(), *bwd.values()))
