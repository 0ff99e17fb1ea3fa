"""Symmetric proposals at scale: where the current plan is replicated over copies of its
devices (``simulator.symmetry``: R copies, φ_r: C_0 -> C_r), a proposal that changes ops' configs
changes them alike in every copy, so it stays foldable (one copy simulated for all,
``simulator.fold``) instead of falling to a per-device simulation.

A changed config's partitions are split as folding reads them: its sample dim's coordinates
into R runs, run r to copy r. Run 0's devices are taken to their copy-0 images (φ_r⁻¹) and run r
is set to φ_r of those: the change the move made in copy 0, made in every copy. A proposal
already replicated over R copies is kept as drawn, and so is a global move's (``kind``
"global": it re-derives every op from a factorization, replicated over its data-parallel
degree); any other whose change cannot be imaged (its sample dim not cut a multiple of R ways,
two partitions of one run on the images of one device) is no proposal: replicated over fewer
copies, it would be simulated on copies of more devices each (an op's sample cut 2 ways in
a plan of 32 copies of GPT-3 175B's 32 devices leaves 2 copies of 512: its simulation takes
tens of GiB). Likewise an op move (one op's config, or it with its neighbours') from a plan
of three or more tensor-parallel members alike on every op (``strategies.member_symmetry``) is
no proposal where it leaves those members: such a plan cannot fold on its members
(``simulator.fold_members``) and is simulated with every one (GPT-3 175B's ``megatron_lm`` on
1,024 GPUs: 5.76 M tasks instead of 1.55 M, ``benchmarks/scale.py --proposals``), and it
moves one op off its layer's tensor-parallel layout (those drawn there ran 4-8 times the plan's
iteration time). So is one that keeps the members' cuts but whose lowering moves pieces across
them (``keeps``, the search's ``Evaluator.keeps_members``): an op placed on another pipeline
stage's devices, which its readers receive by transfers between members where on its own stage
they all-gather it. Lowering members 0 and 1 alone finds it (the member lowering's
``CrossCopy``), where it would be lowered and simulated again on its copies (GPT-3 175B's
``megatron_lm`` on 1,024 GPUs: 4.6 M tasks instead of 1.26 M, at 3.4-7.8 times the plan's
iteration time). The block, repeated-block and global moves change the tensor-parallel
layout of whole blocks or of the plan and are kept as imaged. ``mcmc.run_chain`` applies it to
every proposal where ``Moves.symmetric`` is set: by ``search`` from ``FOLD_FROM`` devices,
where simulations fold (below, the plain moves)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from simulator.symmetry import Copies, copies_of, find_copies
from soapsearch.search.repeatmove import replaced
from strategies.config import ParallelConfig
from strategies.graph import OpGraph
from strategies.lowered import WEIGHT_KINDS
from strategies.member_memo import MemberMemo
from strategies.member_symmetry import TensorMembers
from strategies.strategy import Strategy

__all__ = ["SymmetricMoves", "imaged"]

Propose = Callable[..., tuple[Strategy | None, bool]]


def cut_over(cfg: ParallelConfig, sample: int | None, r: int) -> bool:
    """``cfg`` cuts its sample dim (index ``sample``; None: it has none) a multiple of ``r`` ways:
    what replicating it over R copies and imaging it over them both need."""
    return sample is not None and cfg.degrees[sample] % r == 0


def imaged(cfg: ParallelConfig, sample: int | None, copies: Copies) -> ParallelConfig | None:
    """``cfg`` with run r of its sample coordinates on φ_r of run 0's copy-0 images (itself
    where it already is); None where that cannot be (module docstring)."""
    r = copies.count
    if not cut_over(cfg, sample, r):
        return None
    grid = np.moveaxis(np.asarray(cfg.devices, dtype=np.int64).reshape(cfg.degrees), sample, 0)
    shape = grid.shape
    rep, index = copies.representative, {d: i for i, d in enumerate(copies.copies[0])}
    first = [rep.get(d) for d in grid.reshape(r, -1)[0].tolist()]
    if None in first or len(set(first)) != len(first):
        return None
    table = np.asarray(copies.copies, dtype=np.int64)  # [r][i]: φ_r of copy 0's device i
    runs = table[:, [index[d] for d in first]]
    devices = tuple(np.moveaxis(runs.reshape(shape), 0, sample).reshape(-1).tolist())
    return cfg if devices == cfg.devices else replace(cfg, devices=devices)


class SymmetricMoves:
    """Wraps a chain's proposals so that they keep the current plan's copies and, an op move's,
    its tensor-parallel members (module docstring)."""

    KEPT = 8

    def __init__(self, graph: OpGraph, keeps: Callable[[Strategy], bool] | None = None):
        self.graph = graph
        self.keeps = keeps
        """Whether a plan's lowering keeps its members (``Evaluator.keeps_members``): an op move
        whose pieces cross them is no proposal either; None: the members found from the
        configs alone."""
        self._copies: dict[int, tuple[Strategy, Copies | None]] = {}
        self._members: dict[int, tuple[Strategy, TensorMembers | None]] = {}
        self._memo = MemberMemo()
        """``find_members`` of the plans asked, each op cut again only where its config changed
        since the plan asked before (a proposal changes a few)."""

    def copies(self, plan: Strategy) -> Copies | None:
        """``plan``'s copies (``find_copies``), kept for the last plans asked."""
        return self._kept(self._copies, plan, find_copies)

    def members(self, plan: Strategy) -> TensorMembers | None:
        """``plan``'s tensor-parallel members where they are three or more (``find_members``;
        a simulation folds on no fewer, ``lowering_members.fold_of``), else None; kept for the
        last plans asked."""
        return self._kept(self._members, plan, self._at_least_three)

    def _at_least_three(self, graph: OpGraph, plan: Strategy) -> TensorMembers | None:
        found = self._memo.members(graph, plan)
        return found if found is not None and found.count >= 3 else None

    def _kept(self, table: dict, plan: Strategy, find: Callable):
        """``find(graph, plan)``, kept in ``table`` for the last ``KEPT`` plans asked (a chain
        proposes from the same plan until it accepts)."""
        got = table.get(id(plan))
        if got is None or got[0] is not plan:
            if len(table) >= self.KEPT:
                table.pop(next(iter(table)))
            got = table[id(plan)] = (plan, find(self.graph, plan))
        return got[1]

    def image(self, current: Strategy, proposal: Strategy | None, kind: str | None = None) -> Strategy | None:
        """``proposal`` (of move ``kind``) with its changed configs imaged over ``current``'s
        copies (as drawn where ``current`` has none, ``proposal`` is replicated over them by
        itself, or it is a global move's); None where a change cannot be imaged, or where an op
        move (``kind`` "op") leaves ``current``'s tensor-parallel members (``members``), or
        its lowering moves pieces across them (``keeps``)."""
        out = self._imaged(current, proposal, kind)
        if out is None or kind != "op":
            return out
        members = self.members(current)
        if members is not None and (self._memo.members(self.graph, out) != members
                                    or (self.keeps is not None and not self.keeps(out))):
            return None
        return out

    def _imaged(self, current: Strategy, proposal: Strategy | None, kind: str | None) -> Strategy | None:
        """``image`` over the copies alone."""
        if proposal is None:
            return None
        copies = self.copies(current)
        if copies is None or kind == "global":
            return proposal
        graph, r = self.graph, copies.count
        drawn = [(op, cfg, graph[op].sample_dim) for op, cfg in proposal.configs
                 if cfg is not current[op] and graph[op].kind not in WEIGHT_KINDS]
        # a changed op not cut a multiple of R ways on its samples: the proposal is replicated
        # over no R copies (``copies_of`` refuses that op) and cannot be imaged over them (the
        # one answer of both below, without walking every op's devices)
        if not all(cut_over(cfg, sample, r) for _, cfg, sample in drawn):
            return None
        if copies_of(graph, proposal, r) is not None:
            return proposal
        changed = {}
        for op, cfg, sample in drawn:
            image = imaged(cfg, sample, copies)
            if image is None:  # over fewer copies or none
                return None
            if image is not cfg:
                changed[op] = image
        return replaced(proposal, changed) or proposal

    def wrap(self, propose: Propose) -> Propose:
        """``propose`` with its proposals imaged (``image``)."""
        def symmetric(current: Strategy, kind: str) -> tuple[Strategy | None, bool]:
            proposal, block = propose(current, kind)
            return self.image(current, proposal, kind), block
        return symmetric
