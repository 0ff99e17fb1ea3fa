"""Gradient buckets synced after the backward (``Strategy.overlap_grad_reduce`` False,
``strategies.overlap``): each device issues every bucket after its last step
(``last_steps``, the end of ``schedule.device_order`` under GPipe, 1F1B and interleaved 1F1B),
and the simulator starts a bucket's pack only once that step and the pipeline sends after it
are done, so a bucket's all-reduce cannot hold the last send of a stage on a shared NIC
(Megatron-LM's schedule waits its sends before it reduces the gradients). The folded
simulation equals the per-device one and delta simulation equals full simulation on such
plans."""

from __future__ import annotations

import random

import numpy as np
import pytest

from simulator.presets import get_topology
from simulator.simulate import Lowerings, simulate_plan, timed_graph
from simulator.cost import get_cost_model
from strategies.baselines import baseline
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.megatron_layers import layer_recomputed
from strategies.overlap import bucket_issues, last_steps
from strategies.schedule import device_order
from tests.conftest import traced
from tests.simulator.test_fold import _walk, random_small
from tests.simulator.test_fold_members_sim import assert_same


def _megatron(n: int, schedule: str, overlap: bool):
    gpt = traced("gpt", "small")
    v = 2 if schedule == "interleaved" else None
    plan = megatron(gpt, n, tp=2 if n <= 16 else 4, pp=2, microbatches=4, **({"virtual_stages": v} if v else {}))
    if schedule == "gpipe":
        plan = plan.with_microbatches(4, "gpipe")
    return gpt, layer_recomputed(plan, gpt).with_bucket_cap(float(1 << 30)).with_overlap_grad_reduce(overlap)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_last_steps_end_each_devices_order(schedule):
    gpt, plan = _megatron(8, schedule, False)
    assert plan.schedule == schedule
    low = lower(gpt, plan)
    order = device_order(low)
    assert last_steps(low) == {d: steps[-1] for d, steps in order.items()}
    assert last_steps(low, frozenset({0, 5})) == {d: order[d][-1] for d in (0, 5)}
    issues = bucket_issues(low)
    assert issues and all(i.after == order[d][-1] for d, mine in issues.items() for i in mine)


def test_random_plans_issue_every_bucket_after_their_last_step():
    rng = random.Random(3)
    graph = traced("mlp", batch_size=16)
    issued = 0
    for _ in range(6):
        plan = random_small(graph, 4, rng, 2, rng.choice(("gpipe", "1f1b"))).with_overlap_grad_reduce(False)
        low = lower(graph, plan)
        order = device_order(low)
        for d, mine in bucket_issues(low).items():
            assert all(i.after == order[d][-1] for i in mine)
            issued += len(mine)
    assert issued >= 6


def _spans(plan, graph, topo):
    lowerings = Lowerings(graph, plan)
    tg, _, start, end = timed_graph(lowerings.first(topo, False), topo, get_cost_model("analytical"), "adam",
                                    None, True, relower=lowerings)
    return tg, np.asarray(start), np.asarray(end)


def test_a_bucket_starts_after_the_sends_of_the_last_step():
    """T2 × P2 × D2 with one bucket a device set (local DDP): without overlap every pack starts
    after the device's last compute task and the sends it made; with overlap some start before."""
    gpt, plan = _megatron(8, "1f1b", False)
    topo = get_topology("a100-1x8")
    for overlap in (False, True):
        tg, start, end = _spans(plan.with_overlap_grad_reduce(overlap), gpt, topo)
        before = 0
        for d in sorted(set(tg.device)):  # the devices simulated (copy 0: the plan folds)
            mine = [t for t in range(len(tg)) if tg.device[t] == d]
            packs = [t for t in mine if str(tg.name[t]).startswith("pack ")]
            steps = [t for t in mine if isinstance(tg.name[t], tuple) and tg.name[t][0] in ("fwd", "bwd")]
            sends = [t for t in mine if isinstance(tg.name[t], tuple) and str(tg.name[t][0]).startswith("send")]
            done = max(end[t] for t in steps + sends)
            assert packs
            before += sum(start[p] < done for p in packs)
        assert (before == 0) == (not overlap), (overlap, before)


@pytest.mark.parametrize("schedule,preset", [("1f1b", "a100-2x8"), ("interleaved", "a100-4x8")])
def test_folded_simulation_equals_per_device(schedule, preset):
    topo = get_topology(preset)
    gpt, plan = _megatron(topo.num_devices, schedule, False)
    full = simulate_plan(gpt, plan, topo, "analytical", optimizer="adam", fold=False)
    folded = simulate_plan(gpt, plan, topo, "analytical", optimizer="adam", fold=True)
    assert_same(folded, full)
    assert folded.num_tasks < full.num_tasks


def test_delta_simulation_equals_full():
    """A walk of one-op proposals from data parallel without overlap on gpt × 8 (proposals make
    transfers between devices), each simulated with the search's caches and equal to a
    per-device run from scratch."""
    graph = traced("gpt", batch_size=16)
    plan = baseline("data_parallel", graph, 8).with_overlap_grad_reduce(False)
    _walk(graph, "a100-1x8", plan, 8, 4, 0.3, True)


def test_the_cli_records_it_and_simulate_replaces_it(tmp_path, capsys):
    """``plan --no-overlap-grad-reduce`` writes ``"overlap_grad_reduce": false`` and ``show-plan``
    says it; ``simulate`` times the plan's, or the one its flag gives (the same plan as from
    Python)."""
    import json

    from soapsearch.api import simulate
    from soapsearch.cli import main

    out = tmp_path / "plan.json"
    args = ["gpt", "--variant", "small", "--topology", "a100-1x8"]
    assert main(["plan", *args, "--baseline", "megatron", "--tp", "2", "--pp", "2", "--microbatches", "4",
                 "--no-overlap-grad-reduce", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["overlap_grad_reduce"] is False
    capsys.readouterr()
    assert main(["show-plan", str(out)]) == 0
    assert "1f1b, gradients synced after the backward" in capsys.readouterr().out.splitlines()[0]
    graph, got = traced("gpt", "small"), {}
    for overlap, flag in ((None, []), (True, ["--overlap-grad-reduce"])):  # the plan's (false), then replaced
        assert main(["simulate", *args, "--plan", str(out), "--json", *flag]) == 0
        got[overlap] = json.loads(capsys.readouterr().out)["iteration_ms"]
        want = simulate(graph, str(out), topology="a100-1x8", overlap_grad_reduce=overlap)
        assert got[overlap] == pytest.approx(want.iteration_time * 1e3, rel=1e-12)
    assert got[None] != got[True]
