"""Where a partition's inputs and output gradient come from on this rank: weight views, pieces
of producers' outputs (local or received), and what a collective's call or its dual left."""

from __future__ import annotations

from typing import Sequence

import torch

from soapsearch.executor.comm import run_collective
from soapsearch.executor.precision import to_wire
from soapsearch.executor.recipe import Piece, Recipe, Slot
from soapsearch.executor.release import Released
from strategies.lowering import Gate

__all__ = ["Reads"]


def _zeros(out: torch.Tensor | Released) -> torch.Tensor:
    """Zeros like an output or its stand-in."""
    return torch.zeros(out.shape, dtype=out.dtype, device=out.device)


class Reads:
    """Mixed into ``runtime.Executor``: reads and fills its per-step state (``outs``, ``leaves``,
    ``shared``, ``shared_grad``)."""

    def _inputs(self, r: Recipe, saved: Sequence[torch.Tensor | None] | None = None, leaves: bool = True
                ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(inputs, leaves) of ``r``'s partition: weight views, and each input slot's tensor
        (``saved``'s where a recomputation kept it, else gathered), a leaf with
        ``requires_grad`` where the slot cuts the autograd graph (``leaves``; a kept tensor
        detached first)."""
        inputs: list[torch.Tensor | None] = []
        cut: list[torch.Tensor | None] = [None] * len(r.slots)
        for i, s in enumerate(r.slots):
            x = None
            if s is not None and s.weight is not None:
                x = self.weights.view(s.weight, s.index)
            elif s is not None:
                kept = saved[i] if saved is not None else None
                x = kept if kept is not None else self._gather(s)
                if leaves and s.leaf:
                    x = cut[i] = (x.detach() if kept is not None else x).requires_grad_()
            inputs.append(x)
        return inputs, cut

    def _call(self, i: int, backward: bool) -> None:
        """This rank's call of collective ``i`` (``strategies.lowered.Collective``) or of its
        dual. Forward: its holder partition's output in, what the collective leaves this member
        kept for its readers (``_gather``). Backward: the gradients its readers on this rank
        left in their leaves, summed, in; the dual's result kept for the holder's output
        gradient (``_output_grad``)."""
        c = self.lowered.collectives[i]
        group = self.groups.group(c.devices)
        me = c.devices.index(self.rank)
        if not backward:
            holder = self.by_key[(c.op, c.holders[me], c.microbatch)].id
            dtype = getattr(torch, self.lowered.graph[c.op].output.dtype)  # mixed precision: the compute dtype
            self.shared[i] = run_collective(c.kind, to_wire(self.outs[holder].detach(), dtype), group, c.dim)
            return
        grad = None
        for task, slot in self.collective_readers.get(i, ()):
            leaves = self.leaves[task]
            g = leaves[slot].grad if leaves is not None and leaves[slot] is not None else None
            if g is not None:
                grad = g if grad is None else grad + g
                leaves[slot].grad = None  # the readers' gradient buffers go with the dual's call
        if grad is None:
            grad = _zeros(self.shared[i])
        self.shared_grad[i] = run_collective(c.backward_kind, to_wire(grad, self.shared[i].dtype), group, c.dim)

    def _gather(self, s: Slot) -> torch.Tensor:
        """An input read from producers' outputs: detached unless ``s.link``; a piece that is
        the whole input is used as it is, several are copied into one buffer, or, Partial
        sums (``s.partial``), added into it in piece order (the holders' partition order); a
        collective's result as this rank's call left it."""
        if s.collective is not None:
            return self.shared[s.collective].detach()
        if len(s.pieces) == 1 and s.pieces[0].into is None:
            return self._piece(s.pieces[0], s.dtype, s.link)
        if s.partial:
            buf = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            for piece in s.pieces:
                if piece.into is None:
                    buf += self._piece(piece, s.dtype, False)
                else:
                    buf[piece.into] += self._piece(piece, s.dtype, False)
            return buf
        buf = torch.empty(s.shape, dtype=s.dtype, device=self.device)
        for piece in s.pieces:
            buf[piece.into] = self._piece(piece, s.dtype, False)
        return buf

    def _piece(self, piece: Piece, dtype: torch.dtype, link: bool) -> torch.Tensor:
        if piece.peer is not None:
            return self.p2p.recv(piece.shape, dtype, self.device, piece.peer, piece.transfer, False, piece.what)
        t = self.outs[piece.task]
        if not link:
            t = t.detach()
        return t if piece.src is None else t[piece.src]

    def _output_grad(self, r: Recipe, out: torch.Tensor | Released) -> torch.Tensor:
        """The seed of a partition of the graph's output (``step_loss.StepLoss``: 1/m, or 1/(m·C_j)
        once its loss's sum is known), else the sum of the gradient pieces of its consumers:
        their leaves' ``.grad`` on this rank, received from the others."""
        if r.seed is not None:
            seed = torch.full_like(out, r.seed if self.scaler is None else r.seed * self.scaler.scale)
            ls = r.loss_sum
            if ls is not None and ls.count is None and ls.gates is not Gate.STEP:
                seed = seed / self.sums[r.id][1].wait()[1]
            return seed
        grad = None if r.grad_whole else _zeros(out)
        for piece in r.grad_pieces:
            if piece.peer is None:
                leaf = self.leaves[piece.task][piece.slot]
                g = leaf.grad if leaf is not None else None
                if g is None:
                    continue
                if piece.src is not None:
                    g = g[piece.src]
            else:
                g = self.p2p.recv(piece.shape, getattr(torch, r.node.output.dtype), self.device, piece.peer,
                                  piece.transfer, True, piece.what)
            if piece.into is None:
                grad = g if grad is None else grad + g
            else:
                grad[piece.into] += g
        for i, into in r.grad_collectives:
            g = self.shared_grad.pop(i)
            if into is None:
                grad = g if grad is None else grad + g
            else:
                grad[into] += g
        return to_wire(grad, out.dtype) if grad is not None else _zeros(out)
