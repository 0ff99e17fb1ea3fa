"""Symmetric proposals (soapsearch/search/symmove.py): at 64 devices an op move from a
replicated plan is made alike in every copy, so the proposal keeps the plan's copies (one
replicated over fewer copies is dropped, but a global move's), and an op move keeps the plan's
tensor-parallel members; a search there is deterministic for a seed with 1 and 2 workers and
its plan stays foldable."""

import random
from dataclasses import replace

import numpy as np
import pytest

from simulator.symmetry import copies_of, find_copies
from soapsearch.search import search
from soapsearch.search.moves import candidate_configs
from soapsearch.search.symmove import SymmetricMoves, imaged
from strategies.errors import PlanError
from strategies.lowered import WEIGHT_KINDS
from strategies.megatron import megatron
from strategies.member_symmetry import find_members
from tests.conftest import traced


def _runs(cfg, sample, count):
    """``cfg``'s devices as its sample coordinates' ``count`` runs (row r: copy r's)."""
    return np.moveaxis(np.asarray(cfg.devices).reshape(cfg.degrees), sample, 0).reshape(count, -1)


def _from_runs(runs, cfg, sample):
    shape = np.moveaxis(np.empty(cfg.degrees), sample, 0).shape
    return replace(cfg, devices=tuple(np.moveaxis(runs.reshape(shape), 0, sample).reshape(-1).tolist()))


def test_an_op_move_is_made_in_every_copy():
    graph = traced("gpt", batch_size=64)
    current = megatron(graph, 64, tp=2)
    moves = SymmetricMoves(graph)
    copies = moves.copies(current)
    assert (copies.count, copies.size) == (32, 2)
    made = 0
    for op, cfg in current.configs:  # the tensor-parallel pair swapped in copy 0 alone: 1-fold
        sample = graph[op].sample_dim
        if graph[op].kind in WEIGHT_KINDS or _runs(cfg, sample, 32).shape[1] != 2:
            continue
        runs = _runs(cfg, sample, 32).copy()
        runs[0] = runs[0][::-1]
        drawn = _from_runs(runs, cfg, sample)
        proposal = current.replace(op, drawn)
        assert find_copies(graph, proposal) is None
        image = moves.image(current, proposal)
        assert copies_of(graph, image, 32) is not None  # the swap made in every copy: foldable
        new = image[op]
        assert _runs(new, sample, 32).tolist() == [row[::-1] for row in _runs(cfg, sample, 32).tolist()]
        assert imaged(new, sample, copies) is new and imaged(cfg, sample, copies) is cfg
        made += 1
    assert made >= 12  # the 4 blocks' linears and attention at least

    candidates = candidate_configs(graph, 64, 1, 8)
    ops = [op for op in candidates if graph[op].kind not in WEIGHT_KINDS and len(candidates[op]) > 1]
    rng = random.Random(0)
    dropped = fewer = 0
    for _ in range(100):  # drawn configs: kept where replicated over the 32 copies, else dropped
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        image = moves.image(current, proposal, "block")
        if image is None:
            assert copies_of(graph, proposal, 32) is None
            dropped += 1
            found = find_copies(graph, proposal)
            if found is not None:  # over fewer copies of more devices each: dropped, but a global move's
                fewer += 1
                assert found.count < 32 and moves.image(current, proposal, "global") is proposal
        else:
            assert copies_of(graph, image, 32) is not None
    assert dropped > 0 and fewer > 0


def _imaged_plainly(graph, current, proposal, copies):
    """``SymmetricMoves._imaged`` as it reads: kept where replicated over the copies by itself,
    else every changed non-weight config imaged, or None."""
    if copies_of(graph, proposal, copies.count) is not None:
        return proposal
    changed = {}
    for op, cfg in proposal.configs:
        if cfg is current[op] or graph[op].kind in WEIGHT_KINDS:
            continue
        image = imaged(cfg, graph[op].sample_dim, copies)
        if image is None:
            return None
        if image is not cfg:
            changed[op] = image
    return proposal.with_configs({**dict(proposal.configs), **changed}) if changed else proposal


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_a_draw_cut_no_multiple_of_the_copies_is_dropped_at_once_as_before(tp, pp):
    """The shortcut (a changed op cut on its samples no multiple of R ways: no proposal) gives what
    the copies check and the imaging give, draw for draw."""
    graph = traced("gpt", batch_size=64)
    current = megatron(graph, 64, tp=tp, pp=pp)
    moves = SymmetricMoves(graph)
    copies = moves.copies(current)
    candidates = {op: cfgs for op, cfgs in candidate_configs(graph, 64, 1, 8).items() if len(cfgs) > 1}
    rng = random.Random(pp)
    swapped = {}  # a tensor-parallel pair swapped in copy 0 alone: imaged into every copy
    for op, cfg in current.configs:
        sample = graph[op].sample_dim
        if graph[op].kind not in WEIGHT_KINDS and _runs(cfg, sample, copies.count).shape[1] > 1:
            runs = _runs(cfg, sample, copies.count).copy()
            runs[0] = runs[0][::-1]
            swapped[op] = [_from_runs(runs, cfg, sample)]
    kinds = {"none": 0, "kept": 0, "imaged": 0}
    for _ in range(300):
        table = swapped if rng.random() < 0.3 else candidates
        ops_drawn = rng.sample(sorted(table), rng.choice((1, 1, 2)))
        proposal = current.with_configs({**dict(current.configs),
                                         **{op: rng.choice(table[op]) for op in ops_drawn}})
        got, want = moves.image(current, proposal, "block"), _imaged_plainly(graph, current, proposal, copies)
        assert (got is None) == (want is None)
        if got is not None:
            assert got.configs == want.configs
        kinds["none" if got is None else "kept" if got is proposal else "imaged"] += 1
    assert all(kinds.values()), kinds


def test_an_op_move_keeps_the_plan_s_tensor_parallel_members():
    graph = traced("gpt", "small", batch_size=64)
    current = megatron(graph, 64, tp=4)
    moves = SymmetricMoves(graph)
    members = moves.members(current)
    assert members is not None and members.count == 4 and moves.members(megatron(graph, 64, tp=2)) is None
    candidates = candidate_configs(graph, 64, 1, 8)
    ops = [op for op in candidates if graph[op].kind not in WEIGHT_KINDS and len(candidates[op]) > 1]
    rng = random.Random(0)
    kept = left = 0
    for _ in range(2000):  # most draws are not replicated over the 16 copies: dropped by both
        op = rng.choice(ops)
        proposal = current.replace(op, rng.choice(candidates[op]))
        image, copied = moves.image(current, proposal, "op"), moves.image(current, proposal, "block")
        if image is not None:  # kept over the copies and the members alike
            assert image == copied and find_members(graph, image) == members
            kept += 1
        elif copied is not None:  # imaged over the copies, but off the members: simulated with all 4
            assert find_members(graph, copied) != members
            left += 1
    assert kept > 0 and left > 0


@pytest.mark.slow
def test_search_at_64_devices_keeps_the_plan_foldable_and_is_deterministic():
    graph = traced("gpt", batch_size=64)
    kw = dict(topology="a100-8x8", budget_s=None, proposals=24, seed=2, chains=2, init="data_parallel",
              exhaustive_limit=0, global_move=0.0)
    one, two = (search(graph, workers=w, **kw) for w in (1, 2))
    assert one.strategy == two.strategy and one.predicted_ms == two.predicted_ms
    assert find_copies(graph, one.strategy) is not None
    assert one.predicted_ms <= min(one.baselines.values()) * (1 + 1e-12)


def test_an_op_move_whose_pieces_cross_the_members_is_no_proposal():
    """A LayerNorm of the first pipeline stage placed on the second stage's devices, its cut
    kept: the members found from the configs are the plan's, but the column linears read it by
    transfers between members where they all-gathered it (its lowering refuses the member fold,
    and the plan would be simulated on its copies). With the Evaluator's member check it is
    no proposal. Of drawn op moves kept over the copies and members, the check drops exactly
    those the member lowering refuses."""
    from simulator.cost import get_cost_model
    from simulator.presets import get_topology
    from simulator.simulate import Lowerings
    from soapsearch.search.evaluator import Evaluator
    from strategies.lowering_members import MemberFold

    graph, topo = traced("gpt", "small", batch_size=64), get_topology("a100-8x8")
    current = megatron(graph, 64, tp=4, pp=2, microbatches=2, sequence_parallel=True)
    evaluate = Evaluator(graph, topo, get_cost_model("analytical"))
    evaluate(current)
    checked, plain = SymmetricMoves(graph, evaluate.keeps_members), SymmetricMoves(graph)
    ln = next(n.name for n in graph if n.kind == "layernorm")
    cfg = current[ln]
    assert max(cfg.devices) < 32  # the first stage's
    moved = current.replace(ln, replace(cfg, devices=tuple(d + 32 for d in cfg.devices)))
    assert find_members(graph, moved) == find_members(graph, current)
    assert plain.image(current, moved, "op") == moved
    assert checked.image(current, moved, "op") is None
    lowerings = Lowerings(graph, moved)
    assert not isinstance(lowerings.first(topo, True).copies, MemberFold)
    assert "crosses members" in lowerings.why
    # drawn op moves: each the check drops is refused by the member lowering, each it keeps folds
    candidates = candidate_configs(graph, 64, 2, 8)
    ops = [op for op in candidates if len(candidates[op]) > 1]
    rng = random.Random(0)
    kept = dropped = 0
    for _ in range(600):
        op = rng.choice(ops)
        proposal = plain.image(current, current.replace(op, rng.choice(candidates[op])), "op")
        if proposal is None:
            continue
        lowerings = Lowerings(graph, proposal)
        folded = isinstance(lowerings.first(topo, True).copies, MemberFold)
        if checked.image(current, proposal, "op") is None:
            assert not folded and "crosses members" in lowerings.why, (op, lowerings.why)
            dropped += 1
        else:
            assert folded, (op, lowerings.why)
            kept += 1
    assert kept > 0 and dropped > 0
    # a plan the lowering refuses (2 stages cannot interleave): left to its scoring, which refuses it
    bad = current.with_microbatches(2, "interleaved")
    assert evaluate.keeps_members(bad)
    with pytest.raises(PlanError, match="interleaved needs"):
        evaluate(bad)
