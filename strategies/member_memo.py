"""What decides a plan's member fold, kept across a search's plans (``MemberMemo``; the fold:
``strategies.lowering_members``, docs/design.md "Member folding").

A search's proposal changes one op's config (or a few), and shares every other config object
with the plan it came from. Two things ``simulator.simulate.Lowerings.first`` decides per plan
are then known from the plan before:

- the members (``find_members``): a function of each non-weight op's cut (``op_cut``: its
  groups, and for an op of groups of one its sizes and config). The memo keeps each op's cut
  and how many ops hold each distinct one; a plan's ops whose config is not the very object of
  the last plan's (``lowering_cache.changed_ops``) are cut again, and ``members_of`` runs on
  the distinct cuts only where they changed: the same ``TensorMembers`` as ``find_members``;
- a member lowering's refusal (``CrossCopy`` naming its op: a transfer across members, a member
  m ≥ 2 unlike its member-1 image). An op's pieces are a function of the plan's precision,
  micro-batches and devices, the fold (copy 0's kept devices), the op's config and its
  producers' configs (the lowering cache's key, ``lowering_cache.update``; its consumers'
  recompute flags change only bytes kept), so a plan that gives a refusing op the same of
  all of these is refused again: ``refused`` says so without lowering it (the plan is
  lowered on its copies alone, as it would be after the refusal).
"""

from __future__ import annotations

from strategies.graph import OpGraph
from strategies.lowered import WEIGHT_KINDS
from strategies.lowering_cache import changed_ops
from strategies.lowering_members import MemberFold, fold_of
from strategies.member_symmetry import OpCut, TensorMembers, members_of, op_cut
from strategies.strategy import Strategy
from strategies.symmetry import Copies, CrossCopy

__all__ = ["MEMO", "REFUSALS", "MemberMemo", "member_memo"]

MEMO = ("member memo",)
"""The lowering cache's key of its ``MemberMemo`` (``member_memo``)."""

REFUSALS = 256
"""Refusals a ``MemberMemo`` keeps (each op's configs a few hundred bytes); past it, all are
forgotten and found again by lowering."""

_NONE = object()


class MemberMemo:
    """The members of the last plan asked, each op's cut, the member folds of those members by
    copy set, and the refusals seen (module docstring). Exact: ``members`` is ``find_members``
    of the plan, ``fold`` ``member_fold``'s, and ``refused`` names a refusal only where lowering
    the plan on that fold raises one."""

    def __init__(self) -> None:
        self.configs: tuple | None = None
        """The last plan's (op, config) pairs (``changed_ops`` reads them)."""
        self._cuts: dict[str, OpCut | None] = {}
        self._held: dict[tuple, list] = {}  # cut key -> [cut, ops holding it]
        self._uncut = 0  # ops whose cut is None
        self._found: TensorMembers | None = None
        self._folds: dict[tuple, MemberFold | str] = {}
        self._refused: dict[tuple, dict[str, dict[tuple, str]]] = {}
        self._count = 0

    def members(self, graph: OpGraph, plan: Strategy) -> TensorMembers | None:
        """``find_members(graph, plan)``, cutting again only the ops whose config changed."""
        changed = changed_ops(self if self.configs is not None else None, plan.configs)
        if changed is None:  # other ops than the last plan's: every op cut afresh
            self._cuts, self._held, self._uncut = {}, {}, 0
            nodes = [node for node in graph if node.kind not in WEIGHT_KINDS]
        else:
            nodes = [node for node in map(graph.__getitem__, changed) if node.kind not in WEIGHT_KINDS]
        dirty = changed is None
        for node in nodes:
            cut = op_cut(node, plan[node.name])
            old = self._cuts.get(node.name, _NONE)
            if old is not _NONE:
                if old is cut or (old is not None and cut is not None and old.key == cut.key):
                    continue
                self._hold(old, -1)
            self._hold(cut, 1)
            self._cuts[node.name] = cut
            dirty = True
        self.configs = plan.configs
        if dirty:
            self._found = None if self._uncut else members_of(cut for cut, _ in self._held.values())
            self._folds = {}
        return self._found

    def _hold(self, cut: OpCut | None, by: int) -> None:
        if cut is None:
            self._uncut += by
            return
        held = self._held.setdefault(cut.key, [cut, 0])
        held[1] += by
        if not held[1]:
            del self._held[cut.key]

    def fold(self, graph: OpGraph, plan: Strategy, copies: Copies | None) -> MemberFold | str:
        """``member_fold(graph, plan, copies)``: the same object while the members and copies are."""
        found = self.members(graph, plan)
        key = (plan.num_devices, copies)
        got = self._folds.get(key)
        if got is None:
            got = self._folds[key] = fold_of(found, plan.num_devices, copies)
        return got

    def refused(self, graph: OpGraph, plan: Strategy, fold: MemberFold) -> str | None:
        """Why lowering ``plan`` on ``fold`` is refused, where an op refused under the same
        configs before (``refuse``); else None."""
        ops = self._refused.get(_plan_key(plan, fold))
        if ops:
            for op, seen in ops.items():
                why = seen.get(_deciding(graph, plan, op))
                if why is not None:
                    return why
        return None

    def refuse(self, graph: OpGraph, plan: Strategy, fold: MemberFold, error: CrossCopy) -> None:
        """Remember that lowering ``plan`` on ``fold`` raised ``error`` at its op (``error.op``)."""
        if error.op is None:
            return
        if self._count >= REFUSALS:
            self._refused, self._count = {}, 0
        seen = self._refused.setdefault(_plan_key(plan, fold), {}).setdefault(error.op, {})
        key = _deciding(graph, plan, error.op)
        if key not in seen:
            seen[key] = str(error)
            self._count += 1


def _plan_key(plan: Strategy, fold: MemberFold) -> tuple:
    return plan.precision, plan.microbatches, plan.num_devices, fold


def _deciding(graph: OpGraph, plan: Strategy, op: str) -> tuple:
    """The configs ``op``'s pieces are a function of besides ``_plan_key``: its own, its producers'."""
    return plan[op], tuple(map(plan.__getitem__, graph[op].inputs))


def member_memo(cache: dict) -> MemberMemo:
    """The ``MemberMemo`` a lowering cache holds (made where it holds none), made its most recent
    entry: a bounded cache (``lowering_bytes.LoweringCache.trim``) drops its oldest first."""
    memo = cache.get(MEMO)
    if memo is None:
        memo = MemberMemo()
    else:
        cache.pop(MEMO, None)
    cache[MEMO] = memo
    return memo
