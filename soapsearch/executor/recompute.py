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
        self._hollow(out, self.readers.get(i, ()), self.recipes[i].part.op, own_outputs=True)

    def _let_go(self, i: int) -> None:
        """Let go of what collective ``i`` left this rank (``strategies.collective_buffers``): its
        entry becomes a stand-in and its readers' leaf copies are hollowed (their ``.grad`` stays
        for the dual), a transient one only where no reader's graph saved it."""
        out = self.shared[i]
        if isinstance(out, Released):
            return
        self.shared[i] = release(out)
        self._hollow(out, self.collective_readers[i], self.lowered.collectives[i].op, own_outputs=False)

    def _hollow(self, out, readers, producer: str, own_outputs: bool) -> None:
        """Hollow the leaf copies of ``out`` its ``readers`` ((partition, slot) pairs) hold, each
        checked first against its reader's saved storages where the reader has them
        (``SavedStorages.check``, naming ``producer``); with ``own_outputs``, a leaf that is its
        reader's output is kept."""
        for c, k in readers:
            leaf = self.leaves[c][k] if self.leaves[c] is not None else None
            if leaf is None or (own_outputs and leaf is self.outs[c]) or not shares(leaf, out):
                continue
            if c in self.saved_storages:
                r = self.recipes[c]
                self.saved_storages[c].check(leaf, r.part.op, r.node.kind, producer)
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
