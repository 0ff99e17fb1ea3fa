"""Sharded weight state priced by the simulator (``ParallelConfig.zero``, ``strategies.zero``):
the memory model's categories equal the ZeRO paper's count by hand (Rajbhandari et al. 2020, §5
table 1: Ψ parameters, N replicas, K optimizer bytes per parameter) for levels 0-2, SGD and
Adam, model precision and bf16; a sharded bucket is a ring reduce-scatter of the padded flat
bucket and, after the update, a ring all-gather of the chunks (``simulator.comm``); and delta
simulation equals full simulation on walks that change levels."""

from __future__ import annotations

import random

import pytest

from simulator.comm import allgather_time, reduce_scatter_time
from simulator.cost import get_cost_model
from simulator.memory import memory_breakdown, peak_memory
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from simulator.taskgraph import label
from soapsearch import zoo
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import data_parallel
from strategies.errors import PlanError
from strategies.lowering import lower, lower_reference
from strategies.zero import gather_groups, gather_uses
from tests.conftest import traced
from tests.executor.plans import zero

N = 4
STATE = {"sgd": 4, "adam": 8}
"""Optimizer state bytes per parameter, float32: SGD's momentum, Adam's two moments."""


def _psi(name: str, n: int) -> tuple[int, int, int, int]:
    """Ψ: the model's trainable parameters, counted from the module itself; Σ over them of each
    one's chunk, ⌈numel / n⌉ (levels 2 and 3 chunk each weight on its own: Ψ/N when every size
    divides); the most one module holds (what one use gathers); and the most a module's use
    holds at level 3 with the next one's weights prefetched: 2 w_i + w_next over the modules in
    forward order, then in backward order (``strategies.prefetch``)."""
    model, _ = zoo.build(name, "tiny")
    params = [p for p in model.parameters() if p.requires_grad]
    own = [sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in model.modules()]
    chain = [w for w in own if w]
    chain += chain[::-1]
    ahead = max(2 * a + b for a, b in zip(chain, chain[1:]))
    return sum(p.numel() for p in params), sum(-(-p.numel() // n) for p in params), max(own), ahead


@pytest.mark.parametrize("precision", ["model", "bf16"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_memory_categories_are_the_papers_count(level, optimizer, precision):
    """zoo mlp, data parallel on N = 2 devices (Ψ and every weight's size even: chunks need no
    padding). Weights 4Ψ bytes (2Ψ in bf16), Ψ/N at level 3; gradients 4Ψ, Ψ/N at levels 2
    and 3; optimizer state and master K·Ψ at level 0 (K = 4 SGD / 8 Adam of state, + 4 of
    float32 master in bf16: the paper's 12 for Adam), K·Ψ/N at levels 1-3; in model precision
    levels 1 and 2 keep the Ψ/N float32 working copy of the chunk (level 3's chunk is the weight
    itself); per use, level 2 holds the largest module's full gradient before its
    reduce-scatter, level 3 also its gathered weights (twice) and the next module's, prefetched."""
    n = 2
    g, (psi, chunks, largest, ahead) = traced("mlp"), _psi("mlp", n)
    assert psi % n == 0 and chunks * n == psi
    plan = zero(level, data_parallel(g, n), g)
    if precision != "model":
        plan = plan.with_precision(precision)
    low = lower(g, plan)
    b = 4 if precision == "model" else 2
    share = psi // n if level else psi
    for d, got in enumerate(memory_breakdown(low, optimizer)):
        assert got.weights == b * (share if level == 3 else psi), got
        assert got.gradients == b * (share if level >= 2 else psi), got
        assert got.optimizer_state == STATE[optimizer] * share, got
        assert got.master_weights == (4 * share if precision != "model" or level in (1, 2) else 0), got
        assert got.gathered_weights == {0: 0, 1: 0, 2: b * largest, 3: b * ahead}[level], got
        assert got.total == peak_memory(low, optimizer)[d]
    if level and precision != "model" and optimizer == "adam":  # the paper's table 1
        base = memory_breakdown(low, optimizer)[0]
        states = base.weights + base.gradients + base.optimizer_state + base.master_weights
        assert states == {1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n, 3: 16 * psi // n}[level]


def test_sharded_buckets_are_reduce_scattered_and_gathered():
    """Data parallel zoo gpt on p100-2x2 at level 1: one reduce-scatter of the padded bucket and
    one all-gather of its chunks, each timed by the ring formula, in place of the all-reduce
    (level 2: no step-end bucket at all)."""
    g, topo = traced("gpt"), get_topology("p100-2x2")
    cost = get_cost_model("analytical")
    psi_bytes = lower(g, data_parallel(g, N)).device_bytes.trainable[0]
    chunk = -(-psi_bytes // 4 // N) * 4
    for level in (0, 1, 2):
        tg = build_tasks(lower(g, zero(level, data_parallel(g, N), g)), topo, cost)
        names = list(map(label, tg.name))
        rs = [i for i, x in enumerate(names) if x.startswith("reducescatter bucket")]
        ag = [i for i, x in enumerate(names) if x.startswith("allgather weights")]
        ar = [i for i, x in enumerate(names) if x.startswith("allreduce bucket")]
        if level != 1:  # level 2: reduce-scattered per use (test_level_2_and_3_per_use)
            assert (len(ar), len(rs)) == ((1, 0) if level == 0 else (0, 0))
            continue
        assert len(rs) == 1 and len(ag) == 1 and not ar
        assert tg.duration[rs[0]] == reduce_scatter_time(topo, tuple(range(N)), chunk * N)
        assert tg.duration[ag[0]] == allgather_time(topo, tuple(range(N)), chunk)


def test_level_1_moves_what_data_parallel_does_and_updates_a_quarter():
    """Ring reduce-scatter + all-gather move what a ring all-reduce does; the update touches a
    quarter of the bytes: the update tasks' bytes are the chunk's."""
    g, topo = traced("gpt"), get_topology("p100-2x2")
    r0 = simulate_plan(g, data_parallel(g, N), topo, optimizer="adam")
    r1 = simulate_plan(g, zero(1, data_parallel(g, N), g), topo, optimizer="adam")
    assert r1.iteration_time != r0.iteration_time
    assert max(r1.peak_memory_bytes) < max(r0.peak_memory_bytes)


@pytest.mark.parametrize("name,topology,microbatches", [("gpt", "p100-2x2", 1), ("mlp", "local-cpu-4", 1)])
def test_delta_equals_full_with_levels(name, topology, microbatches):
    """A walk of one-op proposals, each a config and a level 0-3: the search's Evaluator (delta)
    and a from-scratch simulation agree to the bit on every figure."""
    graph = traced(name, batch_size=16)
    topo = get_topology(topology)
    n, cost = topo.num_devices, get_cost_model("analytical")
    evaluate = Evaluator(graph, topo, cost)
    candidates = candidate_configs(graph, n, microbatches, topo.node_size)
    ops = [op for op in candidates if any(w.trainable for w in graph[op].weights)]
    rng = random.Random(5)
    current = zero(1, data_parallel(graph, n), graph)
    sharded = gathered = 0
    for _ in range(80):
        op = rng.choice(ops)
        cfg = rng.choice(candidates[op]) if rng.random() < 0.5 else current[op]
        proposal = current.replace(op, cfg.with_memory(zero=rng.choice((0, 1, 2, 3))))
        try:
            low = lower_reference(graph, proposal)
            gather_uses(low)
        except PlanError:
            continue
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(graph, proposal, topo, cost, summary=True)
        assert (delta.iteration_time, delta.peak_memory_bytes, delta.busy_time, delta.bytes_moved,
                delta.num_tasks, delta.memory) == (full.iteration_time, full.peak_memory_bytes, full.busy_time,
                                                   full.bytes_moved, full.num_tasks, full.memory), (op, cfg)
        sharded += any(k.zero for k in low.gradient_sync.buckets)
        gathered += any(k.zero == 3 for k in low.gradient_sync.buckets)
        if rng.random() < 0.6:
            current = proposal
    assert sharded > 30 and gathered > 10


@pytest.mark.parametrize("level", [2, 3])
def test_level_2_and_3_per_use(level):
    """Data parallel zoo gpt, 2 micro-batches: per use of a group (a reader partition's shards on
    one device set) and micro-batch one ring reduce-scatter of the group's gradients after the
    backward, at level 3 also two ring all-gathers of its chunks (forward, backward), which the
    forward and backward tasks wait on; no step-end bucket; at level 2 one all-gather of each
    shard's updated chunks after the update."""
    g, topo = traced("gpt", batch_size=16), get_topology("p100-2x2")
    low = lower(g, zero(level, data_parallel(g, N), g).with_microbatches(2, "gpipe"))
    groups = gather_groups(low)
    tg = build_tasks(low, topo, get_cost_model("analytical"))
    names = list(map(label, tg.name))
    fwd = [i for i, x in enumerate(names) if x.startswith("allgather fwd")]
    bwd = [i for i, x in enumerate(names) if x.startswith("allgather bwd")]
    rs = [i for i, x in enumerate(names) if x.startswith("reducescatter grad")]
    after = [i for i, x in enumerate(names) if x.startswith("allgather weights")]
    assert len(groups) < len(gather_uses(low))  # a linear's weight and bias: one group
    assert len(rs) == 2 * len(groups) and not any("bucket" in x for x in names)
    assert len(fwd) == len(bwd) == (2 * len(groups) if level == 3 else 0)
    assert len(after) == (len(low.weight_shards) if level == 2 else 0)
    u = groups[0]
    chunk = sum(-(-s.nbytes // 4 // N) * 4 for s in u.shards)
    assert tg.duration[rs[0]] == reduce_scatter_time(topo, u.devices, chunk * N)
    if level == 3:
        assert tg.duration[fwd[0]] == allgather_time(topo, u.devices, chunk)
        assert {f"fwd {u.op}[{k}]@mb0" for k in u.partitions} <= {names[t] for t in tg.successors(fwd[0])}
        assert {f"bwd {u.op}[{k}]@mb0" for k in u.partitions} <= {names[t] for t in tg.successors(bwd[0])}


@pytest.mark.parametrize("level", [2, 3])
def test_a_weight_and_bias_are_one_collective_per_phase(level):
    """zoo mlp, data parallel on 4 devices: each linear reads a weight and a bias, and issues one
    all-gather per phase (level 3) and one reduce-scatter per micro-batch for both, their bytes
    the sum of the two shards' chunks (⌈numel / n⌉ each, padded on its own), as FSDP2 issues one
    per ``fully_shard`` unit."""
    g, topo = traced("mlp"), get_topology("p100-2x2")
    low = lower(g, zero(level, data_parallel(g, N), g))
    tg = build_tasks(low, topo, get_cost_model("analytical"))
    names = list(map(label, tg.name))
    linears = [n for n in g if {w.role for w in n.weights} >= {"weight", "bias"}]
    assert linears
    for node in linears:
        shards = [s for s in low.weight_shards if node.name in s.ops]
        assert len(shards) == 2
        chunk = sum(-(-s.nbytes // 4 // N) * 4 for s in shards)
        for phase in ("allgather fwd", "allgather bwd", "reducescatter grad"):
            tasks = [i for i, x in enumerate(names) if x.startswith(phase) and f" {node.name}@mb0 " in x]
            if phase != "reducescatter grad" and level == 2:
                assert not tasks
                continue
            assert len(tasks) == 1, (phase, node.name, [names[i] for i in tasks])
            assert tg.nbytes[tasks[0]] == chunk * N
            expect = (reduce_scatter_time(topo, tuple(range(N)), chunk * N) if phase.startswith("reduce")
                      else allgather_time(topo, tuple(range(N)), chunk))
            assert tg.duration[tasks[0]] == expect


def test_level_3_gathers_again_for_a_recomputation():
    """A level-3 weight read by a recomputed op is gathered a third time per micro-batch, for the
    recomputation (the executor gathers it where it recomputes the op); the others twice."""
    from tests.executor.plans import recompute, recompute_ops
    g, topo = traced("gpt", batch_size=16), get_topology("p100-2x2")
    plan = zero(3, data_parallel(g, N), g).with_microbatches(2, "gpipe")
    low = lower(g, recompute(plan, recompute_ops(g, "mlp")))
    tg = build_tasks(low, topo, get_cost_model("analytical"))
    names = list(map(label, tg.name))
    again = {u.op for u in gather_groups(low) if low.strategy[u.op].recompute}
    assert again and again <= set(recompute_ops(g, "mlp"))
    for u in gather_groups(low):
        for phase, count in (("fwd", 1), ("recompute", int(u.op in again)), ("bwd", 1)):
            start = f"allgather {phase} {'+'.join(s.name for s in u.shards)} {u.op}@mb"
            assert sum(x.startswith(start) for x in names) == 2 * count, (phase, u.op)


def _fsdp_start():
    """gpt on p100-2x2 with the FSDP baseline (level 3, 2 micro-batches, 1F1B), simulated once by
    an ``Evaluator`` (its TaskCache holds the plan's blocks and recorded level-2/3 tasks)."""
    from strategies.baselines import BASELINES
    graph, topo, cost = traced("gpt", batch_size=16), get_topology("p100-2x2"), get_cost_model("analytical")
    plan = BASELINES["fsdp"](graph, N).with_microbatches(2, "1f1b")
    evaluate = Evaluator(graph, topo, cost)
    evaluate(plan)
    return graph, topo, cost, plan, evaluate, candidate_configs(graph, N, 2, topo.node_size)


def _delta_recorded(monkeypatch, evaluate, proposal, full) -> tuple[list[str], list[str]]:
    """``proposal`` scored by ``evaluate`` (delta simulation, equal to ``full``): the ops whose
    blocks were built and those whose level-2/3 tasks were recorded (one entry a group and
    micro-batch)."""
    from simulator import tasks, zero3
    built, recorded = [], []
    real_block, real_use = tasks._op_block, zero3._use_tasks
    monkeypatch.setattr(tasks, "_op_block", lambda node, *rest: built.append(node.name) or real_block(node, *rest))
    monkeypatch.setattr(zero3, "_use_tasks", lambda add, edge, topology, u, *rest: recorded.append(u.op)
                        or real_use(add, edge, topology, u, *rest))
    assert evaluate(proposal, summary=True) == full
    return built, recorded


def test_a_proposal_records_only_its_new_groups_once_for_every_micro_batch(monkeypatch):
    """A one-op proposal on an FSDP plan (level 3, 2 micro-batches, 1F1B) moving a reader of
    level-3 weights: only the groups the plan did not have are recorded, each once for both
    micro-batches (``zero3._Chunk`` leaves the micro-batch open), every other group's tasks laid
    out from the TaskCache, whether or not its reader's block was rebuilt; delta equals full
    simulation."""
    graph, topo, cost, plan, evaluate, candidates = _fsdp_start()
    before = set(gather_groups(lower(graph, plan)))
    readers = {u.op for u in before}
    proposal, op = next((p, o) for o in sorted(readers) for c in candidates[o]
                        for p in [plan.replace(o, c.with_memory(plan[o].zero, plan[o].recompute))]
                        if p[o] != plan[o] and o in {u.op for u in gather_groups(lower(graph, p))})
    built, recorded = _delta_recorded(monkeypatch, evaluate, proposal, simulate_plan(graph, proposal, topo, cost))
    new = [u for u in gather_groups(lower(graph, proposal)) if u not in before]
    assert op in built and new
    assert sorted(recorded) == sorted(u.op for u in new)  # one record a group, not one a micro-batch


def test_a_micro_batch_move_records_no_level_3_tasks(monkeypatch):
    """The same plan with a call per op (``fsdp_unit`` "op"), moved from 2 to 4 micro-batches
    (the readers' blocks built again: their tasks are per micro-batch) and back (the blocks of 2
    known): no group is recorded again (a chunk reads its micro-batch and
    its reader block's ids where it is laid out, ``zero3._block_reads``; under "block" a unit's
    call names its micro-batch, so its chunks are recorded per micro-batch); delta equals full
    simulation both ways."""
    graph, topo, cost, plan, evaluate, _ = _fsdp_start()
    plan = plan.with_fsdp_unit("op")
    evaluate(plan)
    for m in (4, 2):
        moved = plan.with_microbatches(m)
        built, recorded = _delta_recorded(monkeypatch, evaluate, moved, simulate_plan(graph, moved, topo, cost))
        assert recorded == []
        assert m == 2 or {u.op for u in gather_groups(lower(graph, moved))} & set(built)


def test_a_rebuilt_reader_keeps_its_level_3_tasks(monkeypatch):
    """A one-op proposal on the same plan moving an op whose consumer reads level-3 weights:
    the consumer's block is rebuilt (the transfers into it change), and its groups' recorded
    tasks serve it unchanged (a chunk reads its reader block's ids where it is laid out,
    ``zero3._block_reads``): only groups that changed are recorded again, and delta equals full
    simulation."""
    graph, topo, cost, plan, evaluate, candidates = _fsdp_start()
    before = set(gather_groups(lower(graph, plan)))
    readers = {u.op for u in before}
    proposal = next(plan.replace(node.name, c.with_memory(plan[node.name].zero, plan[node.name].recompute))
                    for node in graph if node.name not in readers  # read by a level-3 reader, moved
                    and any(x.name in readers for x in graph if node.name in x.inputs)
                    for c in candidates.get(node.name, []) if c != plan[node.name])
    built, recorded = _delta_recorded(monkeypatch, evaluate, proposal, simulate_plan(graph, proposal, topo, cost))
    after = gather_groups(lower(graph, proposal))
    rebuilt = {u.op for u in after if u in before} & set(built)  # readers rebuilt, their groups unchanged
    assert rebuilt
    assert not rebuilt & set(recorded)
    assert set(recorded) <= {u.op for u in after if u not in before}


def _graph_facts(tg, start, end) -> tuple:
    """Every task's label and columns, the edges in order, and the event times."""
    src, dst = tg.edge_arrays()
    return (list(map(label, tg.name)), list(tg.category), list(tg.duration), list(tg.resources), list(tg.device),
            list(tg.nbytes), src.tolist(), dst.tolist(), list(start), list(end))


def _built(graph, plan, topo, cost, fold: bool) -> tuple:
    """``_graph_facts`` of ``plan`` simulated from scratch (no task cache)."""
    from simulator.simulate import Lowerings, timed_graph
    lowerings = Lowerings(graph, plan)
    tg, _, start, end = timed_graph(lowerings.first(topo, fold), topo, cost, "adam", None, fold, relower=lowerings)
    return _graph_facts(tg, start, end)


def _random_zero(seed: int, level, units: str):
    """zoo gpt on 4 devices: fsdp (odd seeds) or a random plan, each weighted op at ``level(rng,
    config)``, some recomputed, ``units``, 2 or 4 micro-batches under either schedule; the
    analytical model, with FSDP2's copies on odd seeds."""
    from strategies.baselines import BASELINES
    from tests.executor.plans import make_plan
    rng = random.Random(seed)
    graph = traced("gpt", batch_size=16)
    plan = BASELINES["fsdp"](graph, N) if seed % 2 else make_plan(graph, f"random{seed}", N)
    plan = plan.with_configs({op: c.with_memory(zero=level(rng, c), recompute=c.recompute or rng.random() < 0.2)
                              if any(w.trainable for w in graph[op].weights) else c for op, c in plan.items()})
    plan = plan.with_fsdp_unit(units).with_microbatches(rng.choice([2, 4]), rng.choice(["gpipe", "1f1b"]))
    return graph, plan, get_cost_model("analytical", fsdp_copies=bool(seed % 2))


@pytest.mark.parametrize("seed", range(4))
def test_issue_positions_laid_as_rows_equal_step_by_step(monkeypatch, seed):
    """Where a member's gathering steps repeat in every micro-batch, ``zero3._issue_tasks`` keys
    one micro-batch's and lays the others out as rows (``_per_microbatch``): the same graph as
    keyed step by step, on random ZeRO-3 plans ("op" units on even seeds, "block" on odd),
    per device and folded; and the rows are taken on each of them."""
    from simulator import zero3
    graph, plan, cost = _random_zero(seed, lambda rng, c: 3, ("op", "block")[seed % 2])
    topo = get_topology("p100-2x2")
    rows, taken = zero3._per_microbatch, []

    def watched(*args):
        taken.append(rows(*args))
        return taken[-1]
    for fold in (True, False):
        monkeypatch.setattr(zero3, "_per_microbatch", watched)
        keyed = _built(graph, plan, topo, cost, fold)
        monkeypatch.setattr(zero3, "_per_microbatch", lambda *args: None)
        assert keyed == _built(graph, plan, topo, cost, fold)
    assert taken and None not in taken


@pytest.mark.parametrize("seed", range(4))
def test_chunks_laid_as_one_equal_chunks_laid_apart(monkeypatch, seed):
    """Where no unit call is made, every micro-batch's level-2/3 chunks are merged and laid out
    once a micro-batch (``zero3._merged``, from ``MERGED_FROM`` micro-batches): the same tasks,
    labels, edges in the same order and event times as each chunk laid out apart, on random
    plans with random levels, recompute and micro-batch counts, with and without FSDP2's copies,
    per device and folded."""
    from simulator import zero3
    graph, plan, cost = _random_zero(seed, lambda rng, c: rng.choice([c.zero, 2, 3]) if c.zero or rng.random() < 0.5
                                     else c.zero, "op")
    topo = get_topology("p100-2x2")
    assert any(u.zero == 3 for u in gather_groups(lower(graph, plan)))
    for fold in (True, False):
        built = []
        for merged_from in (zero3.MERGED_FROM, 1 << 30):
            monkeypatch.setattr(zero3, "MERGED_FROM", merged_from)
            built.append(_built(graph, plan, topo, cost, fold))
        assert built[0] == built[1]
