"""Letting go of a transient output by dropping references (``soapsearch/executor/release.py``):
the stand-in's backward equals the output's, a hollowed leaf still takes its gradient and holds
one element, a view made before keeps the storage and its values, and a leaf its own graph
saved is refused in one line, as is a let-go result that a regathered view reads before its
second gather."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from soapsearch.executor.errors import ExecutorError
from soapsearch.executor.release import Regathered, Released, SavedStorages, hollow, regathered, release, shares


def test_the_stand_in_runs_the_backward_of_the_output():
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    y = torch.arange(6.0).reshape(2, 3).requires_grad_()
    out_x, out_y = x * 3, y * 3
    stand_in = release(out_x)
    assert isinstance(stand_in, Released) and stand_in.requires_grad and stand_in.shape == (2, 3)
    del out_x
    grad = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    torch.autograd.backward(stand_in.edge, grad)
    torch.autograd.backward(out_y, grad)
    assert torch.equal(x.grad, y.grad) and torch.equal(x.grad, 3 * grad)
    assert not release(torch.ones(2)).requires_grad


def test_a_hollowed_leaf_takes_its_gradient_and_a_view_keeps_the_values():
    produced = torch.arange(12.0).reshape(3, 4)
    leaf = produced.detach().requires_grad_()
    view = leaf.t()  # a reader's view of it, made before the leaf is hollowed
    out = leaf + 1  # an add saves nothing of its input
    assert shares(leaf, produced)
    hollow(leaf)
    assert not shares(leaf, produced) and leaf.untyped_storage().nbytes() == 4 and leaf.shape == (3, 4)
    assert torch.equal(view, produced.t())  # the storage stays while the view reads it
    out.backward(torch.full((3, 4), 2.0))
    assert torch.equal(leaf.grad, torch.full((3, 4), 2.0))


def test_a_leaf_its_own_graph_saved_is_refused():
    leaf = torch.ones(2, 3).requires_grad_()
    seen = SavedStorages()
    with seen.hooks():
        out = torch.nn.functional.linear(leaf, torch.ones(4, 3, requires_grad=True))  # saves its input
    with pytest.raises(ExecutorError, match=r"^op 'fc' \(linear\): its backward reads its input from 'ln', which "
                       r"strategies.saved counts as read by no backward \(transient\)$"):
        seen.check(leaf, "fc", "linear", "ln")
    other = SavedStorages()
    with other.hooks():
        (leaf + 1).sum()
    other.check(leaf, "add", "add", "ln")  # an add saved nothing
    assert out.shape == (2, 4)


def test_a_regathered_view_reads_the_second_call_and_a_let_go_result_is_refused():
    """A view of collective 0's result is saved as the call to come and read from the result in
    ``shared`` at the backward; still ``Released`` there (not gathered again), or let go before
    a forward reads it (``regathered``), it is refused in one line rather than read."""
    gathered = torch.arange(12.0).reshape(3, 4)
    slots, lives = [SimpleNamespace(collective=0), None], [SimpleNamespace(regather="fc")]
    shared = {0: gathered}
    seen = SavedStorages(regathered(slots, lives, shared), shared)
    saved = seen.pack(gathered.t())
    assert isinstance(saved, Regathered) and not seen.ptrs
    shared[0] = gathered + 1  # the backward's call
    assert torch.equal(seen.unpack(saved), (gathered + 1).t())
    shared[0] = release(gathered)
    with pytest.raises(ExecutorError, match=r"^collective 0: its result is read by a backward before it was "
                       r"gathered again$"):
        seen.unpack(saved)
    with pytest.raises(ExecutorError, match=r"^collective 0: a forward reads its result after it was let go$"):
        regathered(slots, lives, shared)
