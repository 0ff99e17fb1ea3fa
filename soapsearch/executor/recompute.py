"""Letting go and getting back within a step: transient outputs and collective results let go
after their last reader (``release.py``), recompute partitions recomputed with autograd and
let-go collectives gathered again (docs/design.md, "Recompute")."""

from __future__ import annotations

from soapsearch.executor.recipe import Recipe
from soapsearch.executor.release import Released, hollow, regather_calls, release, shares

__all__ = ["Recompute"]


class Recompute:
    """Mixed into ``runtime.Executor``."""

    def _release(self, i: int) -> None:
        """Let go of transient output ``i`` (``release.py``): its entry becomes a stand-in and
        the leaf copies of it are hollowed, except a leaf that is its reader's output still held
        (an op that returns its input: let go with that output)."""
        out = self.outs[i]
        self.outs[i] = release(out)
        for c, k in self.readers.get(i, ()):
            leaf = self.leaves[c][k] if self.leaves[c] is not None else None
            if leaf is None or leaf is self.outs[c] or not shares(leaf, out):
                continue
            self.saved_storages[c].check(leaf, self.recipes[c].part.op, self.recipes[c].node.kind,
                                         self.recipes[i].part.op)
            hollow(leaf)

    def _let_go(self, i: int) -> None:
        """Let go of what collective ``i`` left this rank (``strategies.collective_buffers``): its
        entry becomes a stand-in and its readers' leaf copies are hollowed (their ``.grad`` stays
        for the dual), a transient one only where no reader's graph saved it."""
        out = self.shared[i]
        if isinstance(out, Released):
            return
        self.shared[i] = release(out)
        for task, slot in self.collective_readers[i]:
            leaf = self.leaves[task][slot] if self.leaves[task] is not None else None
            if leaf is None or not shares(leaf, out):
                continue
            if task in self.saved_storages:
                r = self.recipes[task]
                self.saved_storages[task].check(leaf, r.part.op, r.node.kind, self.lowered.collectives[i].op)
            hollow(leaf)

    def _regraph(self, r: Recipe) -> None:
        """Recompute ``r``'s partition with autograd, as its forward step would have (leaves
        cut where they are), from the inputs it kept and the outputs this rank holds (its
        producers' kept outputs, or dropped ones recomputed at this step or an earlier one).
        Dropout draws the same masks (``dropout_generator``: a function of the step's seed and
        the op, not of a generator's state), so no RNG state needs saving. A collective it reads
        that was let go is gathered again first (``BufferLife.regather``: at the same step on
        every member, before the step's duals)."""
        self._regather(r)
        inputs, self.leaves[r.id] = self._inputs(r, self.saved.pop(r.id))
        self.outs[r.id] = self._run(r, inputs)

    def _regather(self, r: Recipe) -> None:
        """Gather again each collective ``r`` reads that was let go (``release.regather_calls``),
        before the step's duals."""
        for i in regather_calls(r.slots, self.lives, self.shared):
            self._call(i, False)
