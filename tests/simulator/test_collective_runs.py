"""``simulator.collectives``' runs: the collectives of consecutive micro-batches alike but for
the micro-batch recorded once and laid out for each (``_Run``) give the task graph that laying
each collective out on its own gives, task for task, edge for edge, arrival for arrival."""

from __future__ import annotations

import dataclasses

import pytest

import simulator.collectives as collectives
from simulator.collective_twins import Twins
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import Lowerings
from simulator.tasks import build_tasks
from simulator.topology import Topology
from strategies.baselines import megatron_lm, recomputed
from strategies.megatron import megatron
from tests.conftest import traced
from tests.strategies.test_lowering_members import random_plan


def _overhead(preset: str) -> Topology:
    base = get_topology(preset)
    return Topology(base.name + "-overhead", tuple(dataclasses.replace(d, collective_overhead=2e-5)
                                                    for d in base.devices), base.links, base.routes)


def _graph(lowered, topo, cost, monkeypatch, runs: bool):
    """Every task's columns, the edges in order and the schedule's steps, built with runs or
    with every collective laid out on its own."""
    with monkeypatch.context() as m:
        if not runs:
            m.setattr(collectives, "_period", lambda keys, js: len(keys))
        arrivals = []
        real = collectives.add_collectives

        def spy(*a, **k):
            got = real(*a, **k)
            arrivals.append(got.tolist())
            return got

        m.setattr("simulator.tasks.add_collectives", spy)
        tg = build_tasks(lowered, topo, cost, "adam", copies=lowered.copies)
    src, dst = tg.edge_arrays()
    return ([tg.label(t) for t in range(len(tg))], tg.category, tg.duration, tg.resources, tg.device, tg.nbytes,
            src.tolist(), dst.tolist(), arrivals, tg.step_order.tasks.tolist())


def _plans():
    small = traced("gpt", "small")
    sp = megatron(small, 16, tp=4, pp=2, microbatches=4, sequence_parallel=True)
    return [
        pytest.param(sp, "a100-2x8", False, id="megatron-T4-P2-m4-gpipe"),
        pytest.param(recomputed(sp.with_microbatches(4, "1f1b"), small), "a100-2x8", False, id="1f1b-recompute"),
        pytest.param(megatron_lm(small, 16, 4, 2), "overhead", True, id="megatron_lm-overhead-overlap"),
        pytest.param(random_plan(small, 16, 0), "overhead", False, id="random-0"),
        pytest.param(random_plan(small, 16, 1), "a100-2x8", True, id="random-1-overlap"),
    ]


@pytest.mark.parametrize("plan,preset,overlap", _plans())
@pytest.mark.parametrize("fold", [False, True])
def test_runs_equal_one_by_one(plan, preset, overlap, fold, monkeypatch):
    graph = traced("gpt", "small")
    topo = _overhead("a100-2x8") if preset == "overhead" else get_topology(preset)
    cost = get_cost_model("analytical", input_grad_overlap=True) if overlap else get_cost_model("analytical")
    lowered = Lowerings(graph, plan).first(topo, fold)
    periods, real = [], collectives._period
    with monkeypatch.context() as m:
        m.setattr(collectives, "_period", lambda keys, js: periods.append((real(keys, js), len(keys))) or periods[-1][0])
        ran = _graph(lowered, topo, cost, monkeypatch, True)
    alone = _graph(lowered, topo, cost, monkeypatch, False)
    assert len(ran[0]) > 0 and len(ran[8][0]) > 0
    assert any(p < n for p, n in periods)  # some run laid out period by period
    for a, b in zip(ran, alone):
        assert a == b


def _perturbed(monkeypatch, lowered, what: str):
    """Micro-batch 1's collectives made unlike micro-batch 0's in ``what`` (a run key's field):
    its members' forward calls at another partition's step (two partitions of each reader op on
    different devices swap indices, as the schedule reads them), its reads in reverse order, its
    backward hiding nothing behind its readers (``hidden_by_readers``), or its holders reversed."""
    hidden = collectives.hidden_by_readers
    if what == "steps":
        parts = dict(lowered.partitions)
        for op in {reads[0].dst_op for c, reads in lowered.collective_readers.items() if c.microbatch == 1}:
            row = list(parts[op][1])
            other = next((k for k, p in enumerate(row) if p.device != row[0].device), None)
            if other is not None:
                row[0], row[other] = row[0]._replace(index=row[other].index), row[other]._replace(index=row[0].index)
                parts[op] = (parts[op][0], tuple(row), *parts[op][2:])
        monkeypatch.setitem(lowered.__dict__, "partitions", parts)
    elif what == "hidden":
        monkeypatch.setattr(collectives, "hidden_by_readers",
                            lambda lowered, reads, *a: hidden(lowered, reads, *a) * (reads[0].collective.microbatch != 1))


def _reordered(lowered, what: str) -> None:
    """Micro-batch 1's collectives read in reverse order (``what`` "reads") or held in reverse
    (``what`` "holders"), in ``lowered``'s collectives and readers."""
    readers = dict(lowered.collective_readers)
    if what in ("reads", "holders"):
        for c, reads in list(readers.items()):
            if c.microbatch == 1 and len(reads) > 1:
                readers[c] = reads[::-1] if what == "reads" else reads
        if what == "holders":
            flipped = {c: c._replace(holders=c.holders[::-1]) if c.microbatch == 1 else c for c in lowered.collectives}
            lowered.__dict__["collectives"] = tuple(flipped.values())
            readers = {flipped[c]: reads for c, reads in readers.items()}
    lowered.__dict__["collective_readers"] = readers


@pytest.mark.parametrize("what", ["steps", "reads", "hidden", "holders"])
def test_runs_keyed_on_what_differs(what, monkeypatch):
    """Collectives of consecutive micro-batches that differ in one of the run key's fields are
    laid out each on its own: equal to one by one (fails where the key leaves the field out)."""
    graph = traced("gpt", "small")
    plan = megatron_lm(graph, 16, 4, 2)
    topo = _overhead("a100-2x8")
    cost = get_cost_model("analytical", input_grad_overlap=True)
    lowered = Lowerings(graph, plan).first(topo, False)
    _reordered(lowered, what)
    with monkeypatch.context() as m:
        _perturbed(m, lowered, what)
        ran = _graph(lowered, topo, cost, m, True)
        alone = _graph(lowered, topo, cost, m, False)
    for a, b in zip(ran, alone):
        assert a == b


@pytest.mark.parametrize("plan", [pytest.param(p.values[0], id=p.id) for p in _plans()[:3]])
def test_tasks_counted_from_the_lowering(plan, monkeypatch):
    """Counted from the lowering alone, not from ``_record``: each collective one task on its
    links (again where it is re-gathered for a recomputation, and its dual where the gradient
    moves back), of its bytes; one call per member step (``collective_steps``,
    ``regather_steps``), an arrival of one of those tasks; one host task per member and task
    under a collective overhead."""
    import simulator.tasks as tasks_module
    from strategies.collective_buffers import buffer_lives, regather_steps
    from strategies.lowering import lower
    from strategies.schedule import collective_steps

    graph, topo = traced("gpt", "small"), _overhead("a100-2x8")
    lowered = lower(graph, plan)
    got = []
    add = tasks_module.add_collectives
    monkeypatch.setattr(tasks_module, "add_collectives", lambda *a, **k: got.append(add(*a, **k)) or got[-1])
    tg = build_tasks(lowered, topo, get_cost_model("analytical"), "adam")
    kinds = ("all_reduce ", "reduce_scatter ", "all_gather ")
    labels = [tg.label(t) for t in range(len(tg))]
    ours = [t for t, label in enumerate(labels) if label.startswith(kinds) and "@mb" in label]
    main = [t for t in ours if " host device " not in labels[t]]
    (arrivals,) = got
    assert set(arrivals[0].tolist()) <= set(main)
    calls = arrivals.shape[1]
    tasks = nbytes = members = 0
    for life, (fwd, bwd) in zip(buffer_lives(lowered), collective_steps(lowered)):
        c = life.collective
        again = None if life.regather is None else regather_steps(lowered, life)
        n = 1 + (again is not None) + c.grad
        tasks, nbytes = tasks + n, nbytes + n * c.nbytes
        members += len(fwd) + (len(again) if again else 0) + (len(bwd) if c.grad else 0)
    assert (len(main), sum(int(tg.nbytes[t]) for t in main), calls) == (tasks, nbytes, members)
    assert len(ours) - len(main) == sum(len(c.devices) * (1 + c.grad + (life.regather is not None))
                                        for life in buffer_lives(lowered) for c in [life.collective])


def test_later_microbatches_are_twins(monkeypatch):
    """On plans whose micro-batches are cut alike (every plan's: micro-batches divide the
    samples), every collective of micro-batches 1 on takes its twin's key in micro-batch 0
    (``Twins``: no steps, buffer life or regather steps of its own), one by one (``key``) or a
    micro-batch at a time (``run``); where they are not alike, ``test_runs_keyed_on_what_differs``
    shows each laid out on its own."""
    graph = traced("gpt", "small")
    topo, cost = get_topology("a100-2x8"), get_cost_model("analytical", input_grad_overlap=True)
    key, run = Twins.key, Twins.run
    for plan in (megatron_lm(graph, 16, 4, 2), random_plan(graph, 16, 1)):
        lowered = Lowerings(graph, plan).first(topo, False)
        hits: list[tuple] = []
        with monkeypatch.context() as m:
            m.setattr(Twins, "key", lambda self, c, reads, h: hits.append((c, key(self, c, reads, h))) or hits[-1][1])

            def whole(self, cs, reads, *times):
                got = run(self, cs, reads, *times)
                if got is not None:
                    hits.extend((c, "run") for c in cs)
                return got

            m.setattr(Twins, "run", whole)
            build_tasks(lowered, topo, cost, "adam")
        later = [c for c in lowered.collectives if c.microbatch > 0]
        assert later and len(hits) == len(lowered.collectives)
        assert [c for c, key in hits if key is not None] == later


@pytest.mark.parametrize("what,fold", [(what, fold) for what in (None, "steps", "reads", "hidden", "holders")
                                        for fold in (False, True) if not (fold and what == "holders")])
@pytest.mark.parametrize("overlap", [False, True])
def test_whole_microbatch_twins_equal_one_by_one(what, fold, overlap, monkeypatch):
    """``Twins.run`` (a later micro-batch's collectives matched whole against the first's) gives
    the task graph that ``Twins.key`` of each gives, where they are twins and where one field of
    the key differs in micro-batch 1 (``_perturbed``), folded (the collectives of the devices
    kept alone; not with holders reversed, which names partitions the fold does not keep) or
    not; matched whole somewhere on each plan whose twins hide nothing and are all alike."""
    graph = traced("gpt", "small")
    topo = _overhead("a100-2x8")
    cost = get_cost_model("analytical", input_grad_overlap=overlap)
    for plan in (megatron_lm(graph, 16, 4, 2), megatron(graph, 16, tp=4, pp=2, microbatches=4,
                                                        sequence_parallel=True)):
        lowered = Lowerings(graph, plan).first(topo, fold)
        _reordered(lowered, what)
        whole, real = [], Twins.run
        with monkeypatch.context() as m:
            _perturbed(m, lowered, what)
            m.setattr(Twins, "run", lambda self, *a: whole.append(real(self, *a)) or whole[-1])
            ran = _graph(lowered, topo, cost, m, True)
            m.setattr(Twins, "run", lambda self, *a: None)
            alone = _graph(lowered, topo, cost, m, True)
        if not overlap and what in (None, "hidden"):  # overlapped twins hide seconds; a micro-batch 1 unlike
            assert any(whole)                             # the first leaves its op one by one
        for a, b in zip(ran, alone):
            assert a == b
