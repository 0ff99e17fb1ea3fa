"""Letting go of a transient output (``strategies.drops.transient``: no backward reads it) by
dropping the references this rank holds to its storage, never by freeing the storage itself:
the output's entry becomes a ``Released`` stand-in (what its backward step still needs: shape,
dtype, device and autograd's gradient edge), and each leaf copy a consumer read it through
(``x.detach().requires_grad_()``, one storage with the output) is hollowed, its data swapped for
one zero expanded to its shape. The bytes go back to the allocator when the last reference goes,
as autograd frees what no graph saves; a tensor that still reads them (a view, a send in flight,
a tensor autograd saved) keeps them alive and correct, so nothing reads freed memory. A
sequence-parallel all-gather read by linears is not saved at all: autograd saves a
``Regathered`` marker and the collective is called again before the backward step
(``regather_calls``, ``regathered``)."""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from soapsearch.executor.errors import ExecutorError
from strategies.collective_buffers import BufferLife

__all__ = ["Released", "Regathered", "release", "hollow", "shares", "SavedStorages", "collective_releases",
           "regather_calls", "regathered"]


class Released(NamedTuple):
    """A let-go output: its metadata and the edge its gradient enters autograd at (None: it
    needs no gradient); ``torch.autograd.backward(edge, grad)`` runs its backward."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    edge: GradientEdge | None

    @property
    def requires_grad(self) -> bool:
        return self.edge is not None


def release(out: torch.Tensor) -> Released:
    """The stand-in of ``out``, which holds none of its storage."""
    return Released(out.shape, out.dtype, out.device, get_gradient_edge(out) if out.requires_grad else None)


def shares(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """``a`` and ``b`` view one storage."""
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def hollow(leaf: torch.Tensor) -> None:
    """Drop ``leaf``'s reference to its storage: its data becomes one zero expanded to its shape,
    so autograd still accumulates a gradient of that shape into it (its ``.grad``, which the
    producer's backward reads)."""
    leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)


class Regathered(NamedTuple):
    """What autograd saves of a collective's result gathered again in the backward
    (``BufferLife.regather``): the collective and the view it saved, read from the result the
    backward's call leaves (``SavedStorages.unpack``)."""

    collective: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SavedStorages:
    """The storages autograd saves in one forward step (``torch.autograd.graph.saved_tensors_hooks``),
    so a leaf is hollowed only where its own graph saved none of it: a leaf its backward reads
    is an op kind ``strategies.saved`` has wrong, refused in one line rather than a gradient
    computed from zeros. A view of a collective's result that is gathered again
    (``regathered``: its storage -> the collective) is saved as a ``Regathered`` and read back
    from ``shared``, the result the backward's call leaves (Megatron-LM's column-parallel linear
    under sequence parallelism: it saves the shard and gathers again)."""

    def __init__(self, regathered: dict[int, int] | None = None,
                 shared: dict[int, torch.Tensor | Released] | None = None) -> None:
        self.ptrs: set[int] = set()
        self.regathered = regathered or {}
        self.shared = shared

    def pack(self, t: torch.Tensor) -> torch.Tensor | Regathered:
        ptr = t.untyped_storage().data_ptr()
        i = self.regathered.get(ptr)
        if i is not None:
            return Regathered(i, t.size(), t.stride(), t.storage_offset())
        self.ptrs.add(ptr)
        return t

    def unpack(self, x: torch.Tensor | Regathered) -> torch.Tensor:
        if not isinstance(x, Regathered):
            return x
        got = self.shared[x.collective]
        if isinstance(got, Released):
            raise ExecutorError(f"collective {x.collective}: its result is read by a backward before it was "
                                f"gathered again")
        return got.as_strided(x.size, x.stride, x.offset)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def check(self, leaf: torch.Tensor, op: str, kind: str, producer: str) -> None:
        if leaf.untyped_storage().data_ptr() in self.ptrs:
            raise ExecutorError(f"op {op!r} ({kind}): its backward reads its input from {producer!r}, which "
                                f"strategies.saved counts as read by no backward (transient)")


def _regathered_reads(slots: Sequence, lives: Sequence[BufferLife]) -> Iterator[int]:
    """The collectives ``slots`` read that are gathered again (``BufferLife.regather``), in slot order."""
    for s in slots:
        if s is not None and s.collective is not None and lives[s.collective].regather is not None:
            yield s.collective


def regather_calls(slots: Sequence, lives: Sequence[BufferLife], shared: dict) -> list[int]:
    """The collectives a recipe's ``slots`` read that are gathered again (``BufferLife.regather``)
    and were let go (``shared``: collective -> its result or ``Released``): called again at the
    same step on every member, for the reader's recomputation or for the backward of a linear
    that saved the shard (``SavedStorages``); once each, in slot order."""
    return list(dict.fromkeys(c for c in _regathered_reads(slots, lives) if isinstance(shared[c], Released)))


def regathered(slots: Sequence, lives: Sequence[BufferLife], shared: dict) -> dict[int, int]:
    """Storage -> collective, of the results a recipe's ``slots`` read that are gathered again in
    the backward (``SavedStorages``: autograd saves them as the call to come); a result already
    let go is refused in one line (it is let go after its last reader's forward only)."""
    out: dict[int, int] = {}
    for c in _regathered_reads(slots, lives):
        got = shared[c]
        if isinstance(got, Released):
            raise ExecutorError(f"collective {c}: a forward reads its result after it was let go")
        out[got.untyped_storage().data_ptr()] = c
    return out


def collective_releases(lives: Sequence[BufferLife], steps: Sequence[tuple[bool, object]],
                        readers: dict[int, list[tuple[int, int]]]) -> dict[int, list[int]]:
    """Step position -> the collectives (``Lowered.collectives`` index) whose result this rank
    lets go of after that step (``strategies.collective_buffers``): a kept one after the last
    backward step of its readers here, a transient one after their last forward step, one
    gathered again after both.
    ``steps``: this rank's (backward, recipe) in order; ``readers``: collective -> (recipe id,
    input) of its readers here."""
    at = {(backward, r.id): k for k, (backward, r) in enumerate(steps)}
    out: dict[int, list[int]] = {}
    for i, reads in sorted(readers.items()):
        life = lives[i]
        if not life.kept:
            out.setdefault(max(at[(False, task)] for task, _ in reads), []).append(i)
        if life.kept or life.regather is not None:
            out.setdefault(max(at[(True, task)] for task, _ in reads), []).append(i)
    return out
