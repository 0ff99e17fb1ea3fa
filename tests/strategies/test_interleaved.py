"""The interleaved 1F1B schedule (Narayanan et al. SC'21, section 2.2.2; strategies/chunks.py,
strategies/schedule.py): each rank's order against lists written by hand from Megatron-LM's
``forward_backward_pipelining_with_interleaving``, the megatron baseline's chunks, the simulated
bubble against (P − 1)/(v·m) on equal stages, the memory walk, and bad values in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from simulator.memory import activation_peaks
from simulator.simulate import simulate_plan
from soapsearch.trace import trace
from strategies.chunks import pipeline_chunks
from strategies.errors import PlanError
from strategies.lowering import lower
from strategies.megatron import megatron
from strategies.drops import drop_points
from strategies.schedule import device_order, device_passes, interleaved_passes
from tests.conftest import traced


def _written(order: str) -> list[tuple[bool, int, int]]:
    """'F0.1 B2.0 ...': forward or backward, micro-batch . chunk."""
    return [(x[0] == "B", int(x[1:].split(".")[0]), int(x.split(".")[1])) for x in order.split()]


HAND = {  # (P, v, m, rank): warm-up W = min(2(P − r − 1) + (v − 1)P, v·m), then F(k + W) B(k), then the rest
    (2, 2, 4, 0): "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
    (2, 2, 4, 1): "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    (4, 2, 8, 0): "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0 F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 "
                  "F6.1 B0.0 F7.1 B1.0 B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0",
    (4, 2, 8, 3): "F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4.0 B0.0 F5.0 B1.0 F6.0 B2.0 "
                  "F7.0 B3.0 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4.0 B5.0 B6.0 B7.0",
    (2, 2, 2, 0): "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0",  # W = 4 = v·m: every forward first
}


@pytest.mark.parametrize("key", sorted(HAND))
def test_order_is_megatrons(key):
    p, v, m, rank = key
    assert interleaved_passes(m, p, rank, v) == _written(HAND[key])


def test_megatron_baseline_chunks_and_device_order():
    g = traced("gpt")  # 4 blocks: P = 2 ranks x v = 2 chunks of one block each
    plan = megatron(g, 4, tp=2, pp=2, microbatches=4, virtual_stages=2)
    assert plan.schedule == "interleaved"
    c = pipeline_chunks(g, plan)
    assert (c.ranks, c.chunks, dict(c.rank)) == (2, 2, {0: 0, 1: 0, 2: 1, 3: 1})
    assert [c.chunk[x] for x in ("wte", "blocks_0_attn_proj", "blocks_0_mlp_proj", "blocks_1_attn_proj",
                                  "blocks_1_mlp_proj", "cross_entropy", "targets")] == [0, 0, 0, 1, 1, 1, 1]
    assert plan["blocks_1_attn_proj"].devices == plan["blocks_0_attn_proj"].devices == (0, 1)
    order = device_order(lower(g, plan))
    projs = [(s.backward, s.microbatch, s.op) for s in order[0] if s.op.endswith("attn_proj")]
    chunk_op = {0: "blocks_0_attn_proj", 1: "blocks_1_attn_proj"}
    assert projs == [(b, j, chunk_op[k]) for b, j, k in _written(HAND[(2, 2, 4, 0)])]


def _stack(blocks: int = 4, hidden: int = 2048, tokens: int = 16384):
    """A stack of equal MLP blocks (linear -> gelu -> linear) on meta: equal pipeline stages."""
    layers = [m for _ in range(blocks)
              for m in (nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))]
    model = nn.Sequential(*layers).to("meta")
    return trace(model, (torch.empty(tokens, hidden, device="meta"),), name="stack")


def test_bubble_is_p_minus_1_over_v_m():
    """Simulated time / a device's busy time - 1 on 2 ranks of equal stages, 8 micro-batches:
    the 1F1B bubble (P - 1)/m = 1/8 and the interleaved (P - 1)/(v·m) = 1/16 (Narayanan et al.
    SC'21, section 2.2.2), within the P2P transfers' and the update's share."""
    g = _stack()
    for v in (1, 2):
        plan = megatron(g, 2, tp=1, pp=2, microbatches=8, virtual_stages=v)
        r = simulate_plan(g, plan, "a100-1x8")
        bubble = r.iteration_time / max(r.busy_time) - 1
        assert bubble == pytest.approx(1 / (8 * v), abs=0.01), v


def test_memory_walk_holds_more_in_flight():
    """Rank 0 of P = 2, v = 2, m = 4 (F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 ...) holds at most
    chunk 0 of micro-batches 0-3 and chunk 1 of micro-batch 1, after F3.0: 4·K0 + K1, about
    2.5 micro-batches against 1F1B's 2 (Narayanan et al. SC'21, section 2.2.2)."""
    g = traced("gpt")
    low = lower(g, megatron(g, 4, tp=2, pp=2, microbatches=4, virtual_stages=2))
    kept = low.device_bytes.kept
    halves = {c: sum(a[0] for n, a in ((n, low.pieces[n].activations) for n in low.pieces)
                     if pipeline_chunks(g, low.strategy).chunk[n] == c) for c in (0, 1)}
    assert halves[0] + halves[1] == kept[0]
    # each forward pass rises over its start by its chunk's forward rise (its transient outputs,
    # read by no backward, ``strategies.saved``, alive until their consumers' forwards); a
    # backward pass frees its chunk's K (nothing recomputes)
    chunk = pipeline_chunks(g, low.strategy).chunk
    rise = {c: _forward_rise(low, 0, {n for n in low.pieces if chunk[n] == c}) for c in (0, 1)}
    level = peak = 0
    for backward, _, c in device_passes(low)[0]:
        peak = max(peak, level + (0 if backward else rise[c]))
        level += -halves[c] if backward else halves[c]
    assert activation_peaks(low, collectives=False)[0] == peak >= 4 * halves[0] + halves[1] > 2 * kept[0]
    one = lower(g, megatron(g, 4, tp=2, pp=2, microbatches=4))
    assert activation_peaks(one, collectives=False)[0] == 2 * one.device_bytes.kept[0] + _forward_rise(one, 0, set(one.pieces)) - \
        one.device_bytes.kept[0]


def _forward_rise(low, d: int, ops: set[str]) -> int:
    """The highest level of a forward pass of ``ops`` on device ``d`` over its start: each op adds
    what it keeps and its transient output, freed after its last consumer's forward there
    (``drop_points``); none of these plans recomputes."""
    free = {}
    for (op, dev), at in drop_points(low.graph, low.strategy).items():
        if dev == d and op in ops:
            free.setdefault(at.free_after, []).append(op)
    level = peak = 0
    for node in low.graph:
        if node.name in ops:
            p = low.pieces[node.name]
            level += p.activations[d] + (p.dropped[d] if p.dropped else 0)
            peak = max(peak, level)
        level -= sum(low.pieces[x].dropped[d] for x in free.get(node.name, ()))
    return peak


def test_bad_values_are_one_line():
    g = traced("gpt")
    with pytest.raises(PlanError, match=r"^microbatches = 3: .*multiple of pp|virtual_stages = 2: .*multiple of pp"):
        megatron(g, 4, tp=2, pp=2, microbatches=3, virtual_stages=2)
    with pytest.raises(PlanError, match=r"^virtual_stages = 0: must be a whole number >= 1$"):
        megatron(g, 4, tp=2, pp=2, microbatches=2, virtual_stages=0)
    with pytest.raises(PlanError, match=r"^virtual_stages = 4: pp 2 x virtual_stages 4 = 8 stages but the model "
                                        r"has 4 transformer blocks$"):
        megatron(g, 4, tp=2, pp=2, microbatches=2, virtual_stages=4)
    plain = megatron(g, 4, tp=2, pp=2, microbatches=2)  # one stage per rank: no chunks to interleave
    with pytest.raises(PlanError, match=r"^schedule = 'interleaved': the ops in graph order make 2 run\(s\) .* "
                                        r"interleaved needs P·v runs, v >= 2, run s on rank s mod P$"):
        lower(g, plain.with_microbatches(2, "interleaved"))
    two = megatron(g, 4, tp=2, pp=2, microbatches=2, virtual_stages=2)
    with pytest.raises(PlanError, match=r"^microbatches = 1: the interleaved schedule needs a multiple of its 2 "
                                        r"pipeline ranks \(1 % 2 = 1\)$"):
        lower(g, two.with_microbatches(1))


def test_delta_equals_full_and_lowering_is_the_reference():
    """A walk of one-op proposals from the interleaved megatron plan: delta = full simulation
    on every valid one (tests/simulator/delta_walk.py), and the cached lowering equals the
    reference lowering; a proposal that breaks the chunks is refused and skipped."""
    from strategies.lowering_reference import lower_reference
    from tests.simulator.delta_walk import delta_walk
    from tests.strategies.test_lowering_reference import _assert_equal

    graph = traced("gpt", batch_size=8)
    walked = delta_walk(graph, "a100-1x4", lambda n: megatron(graph, n, tp=2, pp=2, microbatches=4,
                                                              virtual_stages=2), (0,), seed=3, steps=10)
    assert len(walked) >= 3
    cache: dict = {}
    for ref in walked:
        assert ref.strategy.schedule == "interleaved"
        _assert_equal(lower(graph, ref.strategy, cache), lower_reference(graph, ref.strategy))


def test_plan_json_round_trip_and_a_broken_file():
    """``"schedule": "interleaved"`` in the plan JSON loads as it was saved; a file whose ops
    no longer form the chunks is refused in one line."""
    from strategies.serialize import load_strategy, strategy_to_json

    g = traced("gpt")
    plan = megatron(g, 4, tp=2, pp=2, microbatches=2, virtual_stages=2)
    obj = strategy_to_json(plan, g)
    assert obj["schedule"] == "interleaved" and load_strategy(obj, g) == plan
    one = strategy_to_json(megatron(g, 4, tp=2, pp=2, microbatches=2), g)
    with pytest.raises(PlanError, match=r"^<plan>: schedule = 'interleaved': the ops in graph order make 2 run"):
        load_strategy({**one, "schedule": "interleaved"}, g)


def test_global_moves_draw_interleaved_factorizations():
    """The global move's factorizations (soapsearch/search/globalmove.py) include 2 chunks per
    rank where pp > 1 divides the micro-batches and 2·pp the layers (a GPT of 4 layers: pp 2),
    and a short walk from one is delta = full."""
    import random

    from simulator.cost import get_cost_model
    from simulator.presets import get_topology
    from soapsearch._models.transformer import GPT, GPTConfig
    from soapsearch.search.api import Evaluator
    from soapsearch.search.globalmove import Factorization, GlobalMoves
    from tests.search.delta_check import assert_delta_equals_full

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, seq_len=16, vocab_size=50))
        tokens = torch.zeros(16, 16, dtype=torch.long)
    graph = trace(model, (tokens, tokens), name="gpt-4-layers")
    evaluate = Evaluator(graph, get_topology("p100-1x4"), get_cost_model("analytical"))
    moves = GlobalMoves(graph, 4, (1, 2, 4), "model", evaluate)
    inter = [f for f in moves.factorizations if f.schedule == "interleaved"]
    assert inter and all(f.pp == 2 and f.microbatches % f.pp == 0 for f in inter)
    plan = moves.plan(Factorization(2, 2, 4, "interleaved", 0, False, False))
    assert plan.schedule == "interleaved" and pipeline_chunks(graph, plan).chunks == 2
    assert_delta_equals_full(evaluate, plan)
    rng, current, made = random.Random(5), plan, 0
    for _ in range(8):  # some draws are no plan (a factorization the graph does not take)
        if made == 2:
            break
        proposal = moves.propose(current, rng)
        if proposal is not None:
            assert_delta_equals_full(evaluate, proposal)
            current, made = proposal, made + 1
    assert made >= 2


def test_replica_folding_is_exact():
    """Data parallel 2 ways over the interleaved pipeline: the folded simulation (one copy,
    simulator/fold.py) equals the per-device one."""
    g = traced("gpt", batch_size=16)
    plan = megatron(g, 8, tp=2, pp=2, microbatches=4, virtual_stages=2)
    folded, every = (simulate_plan(g, plan, "a100-1x8", fold=f) for f in (True, False))
    assert folded.num_tasks < every.num_tasks
    assert (folded.iteration_time, folded.peak_memory_bytes, folded.busy_time) == (
        every.iteration_time, every.peak_memory_bytes, every.busy_time)
