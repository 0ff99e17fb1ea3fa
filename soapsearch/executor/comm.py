"""Communication of the executor: process groups for every replica/reduction device set, the
sum over a group (as an autograd Function too), and tagged point-to-point pieces with timeouts.

Follows torch.distributed's rules: ``new_group`` is called by every rank, in the same order,
for every group (https://pytorch.org/docs/stable/distributed.html#groups); a collective on one
group is called by its members in the same order. Point-to-point pieces carry a tag unique
within a step (gloo matches send and recv by peer and tag, so no order can mismatch).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from soapsearch.executor.errors import ExecutorError
from strategies.lowering import SMALL_SUM
from strategies.rules.cross_entropy import ClassShards

warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)
"""torch 2.13 renames ``reduce_scatter_tensor``; older versions have only that name."""

__all__ = ["ProcessGroups", "Group", "PendingSum", "BucketSum", "AllReduceSum", "all_reduce_sum", "class_shards",
           "P2P", "run_collective"]


class Group:
    """A process group with its members (global ranks, sorted) seen from member ``rank``.

    Small sums (batch statistics, a loss's [s, c]; up to ``SMALL_SUM`` elements over all
    members) are all-gathered and added in member order, so every member gets the same bits,
    in fewer steps: a ring all-reduce is a reduce-scatter then an all-gather, 2(p-1) steps to
    the all-gather's p-1 (Patarasuk & Yuan 2009), and a sum this small is latency-bound.
    Batch statistics sit on the critical path, one or two per batchnorm; a loss's sum is
    started without waiting (``sum_async``) and waited only where its reduction's gates say
    (``strategies.lowering.gates``)."""

    def __init__(self, pg, members: tuple[int, ...]):
        self.pg, self.members = pg, members

    def _all_gather(self, t: torch.Tensor, async_op: bool = False):
        """(work or None, every member's ``t`` in member order): one all-gather."""
        t = t.contiguous()
        rows = [torch.empty_like(t) for _ in self.members]
        return dist.all_gather(rows, t, group=self.pg, async_op=async_op), rows

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t``, stacked in member order (one all-gather)."""
        return torch.stack(self._all_gather(t)[1])

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over the members of ``t`` (a new tensor), the same on every member."""
        if t.numel() * len(self.members) <= SMALL_SUM:
            return self.gather(t).sum(0)
        y = t.detach().clone().contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.pg)
        return y

    def sum_async(self, t: torch.Tensor) -> "PendingSum":
        """Start Σ over the members of small ``t`` (one all-gather, ``async_op``); the sum, in
        member order as ``sum`` takes it, is ``wait()``'s."""
        return PendingSum(*self._all_gather(t.detach(), async_op=True))


class PendingSum:
    """A sum over a group in flight (``Group.sum_async``), or one already known (``work`` None,
    ``rows`` the one term). ``wait`` blocks once, then returns the same tensor."""

    def __init__(self, work, rows: list[torch.Tensor]):
        self.work, self.rows = work, rows
        self.value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.value is None:
            if self.work is not None:
                self.work.wait()
            self.value = torch.stack(self.rows).sum(0)
        return self.value


class BucketSum:
    """A sum that rides a gradient bucket (``LocalWeights.sync_grads``): ``terms`` is this
    member's contribution; the gradient sync sets ``value``, which ``wait`` returns."""

    def __init__(self, terms: torch.Tensor):
        self.terms = terms
        self.value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.value is None:
            raise ExecutorError("a loss sum riding a gradient bucket was read before the gradient sync")
        return self.value


class ProcessGroups:
    """One process group per device set (sorted), created once, in sorted order, on every
    rank. ``get(devices)`` returns None for a set of one device (nothing to reduce)."""

    def __init__(self, device_sets: Iterable[Iterable[int]], world_size: int):
        self.world_size = world_size
        self._groups: dict[tuple[int, ...], object] = {}
        for devices in sorted({tuple(sorted(s)) for s in device_sets if len(set(s)) > 1}):
            # every rank calls new_group for every set, members or not
            self._groups[devices] = dist.new_group(list(devices))

    def get(self, devices: Iterable[int]):
        key = tuple(sorted(devices))
        if len(key) < 2:
            return None
        return self._groups[key]

    def group(self, devices: Iterable[int]) -> Group | None:
        """The group of ``devices`` (None for one device)."""
        pg = self.get(devices)
        return Group(pg, tuple(sorted(devices))) if pg is not None else None

    def __len__(self) -> int:
        return len(self._groups)


class AllReduceSum(torch.autograd.Function):
    """y = Σ_group x; the gradient of every member's x is Σ_group dL/dy (the adjoint of a sum
    that every member receives is a sum again: Megatron-LM's f/g operators, Shoeybi et al. 2019).
    The reduce of a rule's forward whose reduction gates its output (``strategies.lowering.gates``:
    ``Gate.FORWARD``) and that the executor does not run in a fast form of its own (batchnorm: norm.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return group.sum(x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.group.sum(grad.detach()), None


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    return AllReduceSum.apply(x, group)


def class_shards(group: Group) -> ClassShards:
    """The collectives of a class-cut loss partition over its class shards (Megatron-LM's
    parallel cross-entropy): the max as an all-gather of the shards' maxima, the sums as
    ``Group.sum``; no autograd (the gradient is local: ``strategies.rules.cross_entropy``)."""
    return ClassShards(max=lambda t: group.gather(t.detach()).amax(0), sum=group.sum)


def run_collective(kind: str, t: torch.Tensor, group: Group, dim: int | None) -> torch.Tensor:
    """One ``strategies.lowered.Collective`` call on ``group`` with this member's ``t`` (a new
    tensor; ``t`` is left as it is): ``all_reduce`` (Σ over the members), ``reduce_scatter``
    (this member's chunk of that sum along ``dim``, chunk i for member i) or ``all_gather``
    (every member's ``t`` joined along ``dim`` in member order). torch's tensor collectives
    work on dim 0 of contiguous tensors: ``dim`` is moved there and back. Where the backend
    lacks ``reduce_scatter_tensor`` or ``all_gather_into_tensor`` (gloo in some torch versions),
    an all-reduce then this member's slice, or an all-gather into a list then one concatenation,
    gives the same values."""
    if kind == "all_reduce":
        y = t.detach().clone().contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group.pg)
        return y
    n, me = len(group.members), group.members.index(dist.get_rank())
    x = t.detach().movedim(dim, 0).contiguous()
    if kind == "reduce_scatter":
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        try:
            dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group.pg)
        except (RuntimeError, NotImplementedError, ValueError):  # the backend has none: all-reduce, keep our chunk
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.pg)
            out = x.chunk(n)[me].clone()
        return out.movedim(0, dim)
    if kind == "all_gather":
        out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
        try:
            dist.all_gather_into_tensor(out, x, group=group.pg)
        except (RuntimeError, NotImplementedError, ValueError):  # the backend has none: gather into a list
            rows = [torch.empty_like(x) for _ in group.members]
            dist.all_gather(rows, x, group=group.pg)
            out = torch.cat(rows)
        return out.movedim(0, dim)
    raise ValueError(f"collective kind {kind!r} is not one of all_reduce, reduce_scatter, all_gather")


class P2P:
    """Tagged sends and receives on the default group. A piece's tag is its transfer's index
    in the lowering, offset by direction (forward/backward) and the step's parity, so that a
    piece of step i+1 cannot be taken for one of step i. A receive is posted ahead (``post``)
    or when it is needed (``recv``), which takes a posted one first."""

    def __init__(self, num_transfers: int, timeout_s: float, rank: int):
        self.n = max(num_transfers, 1)
        self.timeout = timedelta(seconds=timeout_s)
        self.rank = rank
        self.step = 0
        self._pending: list[tuple[object, torch.Tensor]] = []
        self._posted: dict[tuple[int, int, bool], tuple[object, torch.Tensor]] = {}

    def tag(self, index: int, backward: bool) -> int:
        return ((self.step % 2) * 2 + int(backward)) * self.n + index

    def send(self, t: torch.Tensor, dst: int, index: int, backward: bool) -> None:
        """Start sending ``t`` (kept alive until ``flush``)."""
        buf = t.detach().contiguous()
        self._pending.append((dist.isend(buf, dst, tag=self.tag(index, backward)), buf))

    def post(self, shape, dtype, device, src: int, index: int, backward: bool) -> None:
        """Start receiving a piece of this step that ``recv`` will take."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        self._posted[(src, index, backward)] = (dist.irecv(buf, src, tag=self.tag(index, backward)), buf)

    def recv(self, shape, dtype, device, src: int, index: int, backward: bool, what: str) -> torch.Tensor:
        """Receive one piece (posted ahead or now), waiting at most the timeout; the error names
        the peer and ``what``."""
        posted = self._posted.pop((src, index, backward), None)
        if posted is None:
            buf = torch.empty(shape, dtype=dtype, device=device)
            work = dist.irecv(buf, src, tag=self.tag(index, backward))
        else:
            work, buf = posted
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as e:
            raise ExecutorError(f"rank {self.rank}: no {what} from rank {src} within "
                                f"{self.timeout.total_seconds():.0f} s (is rank {src} alive?): {e}") from None
        if ok is False:
            raise ExecutorError(f"rank {self.rank}: no {what} from rank {src} within "
                                f"{self.timeout.total_seconds():.0f} s")
        return buf

    def flush(self) -> None:
        """Wait for every send of this step, then move to the next step's tags. Every posted
        receive must have been taken."""
        if self._posted:
            src, index, backward = next(iter(self._posted))
            raise ExecutorError(f"rank {self.rank}: {len(self._posted)} posted receive(s) not taken this step, "
                                f"e.g. transfer {index} ({'backward' if backward else 'forward'}) from rank {src}")
        self.wait_sends()
        self.step += 1

    def wait_sends(self) -> None:
        """Wait for every send started so far."""
        for work, _ in self._pending:
            try:
                work.wait(self.timeout)
            except RuntimeError as e:
                raise ExecutorError(f"rank {self.rank}: a send did not complete: {e}") from None
        self._pending.clear()
