"""One rank of a plan: forward and backward of its partitions in the schedule's fixed order,
the pieces the lowering says move, the gradient sync of replicated shards and the optimizer
step (docs/design.md, "Executor"). Nothing here re-derives a region: partitions, transfers, shards
and reductions all come from ``strategies.lowering.lower``; the order from
``strategies.schedule.device_order``; what each partition reads, sends and receives is worked
out once into its recipe (``recipe.py``, which also says where autograd graphs are cut).

The gradient of a partition's output is the sum of the gradient pieces its consumers send back
(or, on this rank, leave in the leaf copies they read); ``autograd.backward(out, grad)`` fills
its inputs' ``.grad``, which go back to the producers.

Receives are posted ahead (``recipe.receives_ahead``): at this rank's first step of micro-batch
j in a direction, every piece of j and j + 1 it will receive in that direction, so a piece moves
as soon as its sender sends it (a receive posted late makes gloo ask the sender for it, a round
trip through the sender's process while it computes).

The loss. The step's loss is L = (1/m)·Σ_j S_j / C_j over the m micro-batches, S_j = Σ_p s_p
and C_j = Σ_p c_p (or the static count C, ``Loss.static_count``) over the loss op's partitions
p, each computing s_p = Σ_{i∈p} w_i·ℓ_i and c_p = Σ_{i∈p} w_i (``Loss.partial``). A partition
outputs s_p / C when C is static, else s_p; right after its forward it starts the sum of
[s_p, c_p] (s_p alone for a static C) over its reduction group (``Group.sum_async``) and goes
on — unless that sum rides a gradient bucket (``strategies.lowering.bucket_sums``: a STEP sum
whose devices and dtype are a bucket's): then its terms are appended to that bucket's flat
all-reduce in the gradient sync (``LocalWeights.sync_grads``; on every member in (op,
micro-batch) order), one collective for both, as DDP's one per step. dL/ds_p = 1/(m·C_j), so
what waits for that sum is what its reduction's gates say (``strategies.lowering.gates``):

- ``Gate.STEP``, static C: the seed is 1/m; nothing waits but the reported loss.
- ``Gate.STEP``, dynamic C (m = 1, a loss partition on every rank): the seed is 1/m, and every local
  gradient is divided by C (every gradient is linear in the seeds, and every seed was C times
  too large): after the gradient sync (1/C·Σ_r g_r = Σ_r g_r/C: the buckets start before C
  is known), shards in no bucket included.
- ``Gate.BACKWARD``: the partition's backward step of micro-batch j waits for the sum; seed 1/(m·C_j).
- a partition alone (no group) knows C_j itself; seed 1/(m·C_j).

The loss's backward has no collective. The reported loss is (1/m)·Σ_j S_j / C_j from the sums;
when some rank holds no loss partition, partition 0's rank counts it and an all-reduce started
after the gradient sync, and waited after the optimizer update it overlaps, tells the others.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import (P2P, BucketSum, Group, PendingSum, ProcessGroups, all_reduce_sum,
                                      class_shards, run_collective)
from soapsearch.executor.config import TrainConfig, make_optimizer
from soapsearch.executor.errors import ExecutorError, check_runnable
from soapsearch.executor.norm import batch_norm
from soapsearch.executor.precision import Autocast, LossScaler, to_wire
from soapsearch.executor.recipe import ROOT, SKIP, Piece, Recipe, Slot, receives_ahead, recipes
from soapsearch.executor.release import (Released, SavedStorages, collective_releases, hollow, regather_calls,
                                       regathered, release, shares)
from soapsearch.executor.shards import LocalWeights
from strategies.collective_buffers import buffer_lives
from strategies.graph import OpGraph
from strategies.lowering import WEIGHT_KINDS, BucketKey, Gate, loss_on_every_device, lower
from strategies.overlap import bucket_issues, bucket_order
from strategies.prefetch import call_key, calls_at, step_units
from strategies.rules import get_rule
from strategies.rules.base import no_reduce
from strategies.rules.cross_entropy import LOCAL, ClassShards
from strategies.rules.norm import uses_batch_stats
from strategies.rules.pointwise import set_dropout_seed
from strategies.schedule import Step, device_order
from strategies.strategy import Strategy

__all__ = ["Executor"]


def tied_names(graph: OpGraph, state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """state_dict key -> the graph weight it is tied to: another name of the same tensor (same
    storage, shape and strides; GPT-2's ``lm_head.weight`` of ``wte.weight``), which the trace
    names once (``soapsearch.trace``), so ``state_dict()`` writes it under both."""
    names = {w.name for n in graph for w in n.weights}
    first = {_storage_key(state[n]): n for n in names if n in state and state[n].data_ptr()}
    return {k: first[_storage_key(v)] for k, v in state.items()
            if k not in names and v.data_ptr() and _storage_key(v) in first}


def _zeros(out: torch.Tensor | Released) -> torch.Tensor:
    """Zeros like an output or its stand-in."""
    return torch.zeros(out.shape, dtype=out.dtype, device=out.device)


def _storage_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _batches_tracked(node) -> str | None:
    """The state_dict name of a batchnorm's num_batches_tracked (None: it tracks none)."""
    rm = node.weight("running_mean") if node.kind == "batchnorm2d" else None
    return rm.name.removesuffix("running_mean") + "num_batches_tracked" if rm is not None else None


class Executor:
    """Runs ``strategy`` on this rank (``dist`` must be initialized; rank = device). ``state``
    is the full model's state_dict (same seed on every rank), ``batch`` the model's positional
    inputs; each step trains on it. With ``trace``, every step appends to ``events`` (the
    caller clears it) one Chrome event per forward and backward step of this rank (category
    "forward" / "backward"), then the step end's: "gradient sync" (the buckets packed,
    all-reduced and copied back, the wait included), "update" (the optimizer step) and "loss"
    twice: before the update, the waits on every loss sum still in flight, the loss value's sum
    over ranks started and the step's sends flushed; after it, that sum waited)."""

    def __init__(self, graph: OpGraph, strategy: Strategy, state: Mapping[str, torch.Tensor],
                 batch: Sequence[Any], config: TrainConfig = TrainConfig(),
                 device: torch.device | str = "cpu", trace: bool = False):
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.lowered = lower(graph, strategy)
        check_runnable(self.lowered, world)
        self.graph, self.strategy, self.config = graph, strategy, config
        self.device = torch.device(device)
        self.batch = [b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch]
        self.base = {k: v.detach().clone() for k, v in state.items()} if self.rank == 0 else {}
        self.tied = tied_names(graph, state)
        low = self.lowered
        self.groups = ProcessGroups([r.devices for r in low.reductions] + [c.devices for c in low.collectives]
                                    + [s.devices for s in low.weight_shards if s.trainable], world)
        self.bucket_groups = ProcessGroups([k.devices for k in bucket_order(low)], world)
        """The gradient buckets' own groups: started mid-backward, their collectives never
        share a group with the backward's collectives (each group needs one order on every member)."""
        self.weights = LocalWeights(low, state, self.rank, self.device)
        params = self.weights.parameters()
        self.optimizer = make_optimizer(params, config) if params else None
        self.autocast = Autocast(strategy, self.device)
        self.scaler = LossScaler(config, self.device) if strategy.precision == "fp16" else None
        """fp16: the dynamic loss scale shared by every rank (``precision.LossScaler``)."""
        self.p2p = P2P(len(low.transfers), config.timeout_s, self.rank)
        order_all = device_order(low)
        order = order_all.get(self.rank, [])
        self.recipes = recipes(low, order, self.rank, self.weights.index, order_all)
        self.collective_readers = {}
        """Collective -> (recipe id, input) of every partition of this rank reading it."""
        for r in self.recipes:
            for i, s in enumerate(r.slots):
                if s is not None and s.collective is not None:
                    self.collective_readers.setdefault(s.collective, []).append((r.id, i))
        self.by_key = by_key = {(r.part.op, r.part.index, r.part.microbatch): r for r in self.recipes}
        self.steps = [(s.backward, by_key[(s.op, s.index, s.microbatch)]) for s in order]
        at = {s: i for i, s in enumerate(order)}
        self.issues: dict[int, list[BucketKey]] = {}
        """Step position -> the gradient buckets started right after it (``strategies.overlap``)."""
        for issue in bucket_issues(low).get(self.rank, ()):
            self.issues.setdefault(at[issue.after], []).append(issue.key)
        self.ahead = receives_ahead(self.steps)
        self.prefetch = self._prefetch()
        """Step position -> the level-3 groups whose all-gathers start at its start
        (``strategies.prefetch``), in call order."""
        self.compute = [self._compute(r, self.groups.group(r.group) if r.group else None,
                                      class_shards(self.groups.group(r.classes)) if r.classes else LOCAL)
                        for r in self.recipes]
        self.loss_everywhere = loss_on_every_device(low)
        self.bn_steps: dict[str, int] = {}
        """Training batches each batchnorm op normalized on this rank (one per micro-batch)."""
        self.bn_base = {n.name: int(state[_batches_tracked(n)]) for n in graph
                        if _batches_tracked(n) in state}
        self.transient = {i for r in self.recipes for i in r.frees if not self.recipes[i].recompute}
        """Recipes whose outputs no backward reads (``strategies.pieces.transient``): let go
        after their last reader's forward step here (``release.py``)."""
        self.readers: dict[int, list[tuple[int, int]]] = {}
        """Transient recipe -> (recipe id, input) of each leaf copy of its output on this rank
        (hollowed when it is let go), its own inputs' leaves included (a view's output is one
        storage with them)."""
        for r in self.recipes:
            for k, s in enumerate(r.slots):
                if s is None or not s.leaf:
                    continue
                for task in {p.task for p in s.pieces if p.peer is None} & self.transient:
                    self.readers.setdefault(task, []).append((r.id, k))
                if r.id in self.transient:
                    self.readers.setdefault(r.id, []).append((r.id, k))
        self.lives = lives = buffer_lives(low)
        """Collective -> how long its buffers live on each member, per micro-batch
        (``strategies.collective_buffers.BufferLife``: kept, let go or gathered again)."""
        self.lets_go = collective_releases(lives, self.steps, self.collective_readers)
        """Step position -> the collectives whose result this rank lets go of after it
        (``strategies.collective_buffers``)."""
        self.guarded = {c for rs in self.readers.values() for c, _ in rs} | {
            task for i, reads in self.collective_readers.items() if not lives[i].kept for task, _ in reads}
        """Recipes whose forward records what autograd saves (``release.SavedStorages``)."""
        self.trace = trace
        self.events: list[dict[str, Any]] = []
        """Chrome trace events ("ph": "X", µs of ``time.perf_counter``), recorded with ``trace``."""
        self._clear()

    def _clear(self) -> None:
        self.outs: list[torch.Tensor | None] = [None] * len(self.recipes)
        self.leaves: list[list[torch.Tensor | None] | None] = [None] * len(self.recipes)
        self.losses: list[torch.Tensor] = []
        """The outputs counted in the step's loss (a graph output that is not a loss op)."""
        self.sums: dict[int, tuple[Recipe, PendingSum | BucketSum]] = {}
        """Loss partition (recipe id) -> its group's sum of [s_p, c_p], in flight, riding a
        bucket or known."""
        self.shared: dict[int, torch.Tensor | Released] = {}
        """Collective -> what its forward call left this rank (its readers read it), a stand-in
        once let go (``_let_go``)."""
        self.shared_grad: dict[int, torch.Tensor] = {}
        """Collective -> what its dual left this rank (its holder's output gradient takes it)."""
        self.saved: dict[int, tuple[torch.Tensor | None, ...]] = {}
        """Recompute partition (recipe id) -> the inputs it keeps for its recomputation
        (``Recipe.keeps``: those received from other ranks), until it is recomputed."""
        self.saved_storages: dict[int, SavedStorages] = {}
        """Guarded recipe -> the storages its forward's autograd graph saved, until its backward."""

    def _prefetch(self) -> list[list]:
        """``self.prefetch``: each step's level-3 groups (its recomputations' first, then its
        own) started at the step ``strategies.prefetch.calls_at`` names (one gathering unit ahead:
        a step, or a repeated block's instance under ``fsdp_unit`` "block", whose groups on one
        device set are one call)."""
        uses = self.weights.fsdp.uses

        def gathered(backward: bool, r: Recipe) -> list:
            again = [self.recipes[i].part for i in r.regraphs] if backward else []
            return [u for p in (*again, r.part) for u in uses.get((p.op, p.index), ()) if u.zero == 3]
        each = [gathered(*step) for step in self.steps]
        units = step_units(self.lowered, [Step(b, r.part.op, r.part.index, r.part.microbatch) for b, r in self.steps])
        return [[call for _, call in calls] for calls in calls_at(each, units, call_key)]

    # --- one step ---------------------------------------------------------------------------
    def step(self, seed: int = 0, update: bool = True) -> float:
        """One training iteration: every step of this rank's order, the gradient sync, the
        optimizer step (unless ``update`` is False); returns the step's loss on every rank."""
        set_dropout_seed(seed)  # this thread runs every forward: the masks of one device
        try:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            clock, events, rank = time.perf_counter, self.events if self.trace else None, self.rank
            p2p, device = self.p2p, self.device
            for position, ((backward, r), ahead) in enumerate(zip(self.steps, self.ahead)):
                t0 = clock() if events is not None else 0.0
                for a in ahead:
                    p2p.post(a.shape, a.dtype, device, a.peer, a.transfer, a.backward)
                try:
                    if self.prefetch[position]:
                        self.weights.fsdp.start(self.prefetch[position])
                    if backward:
                        for i in r.regraphs:  # recompute (docs/design.md, "Recompute")
                            again = self.recipes[i]  # its level-3 weights gathered for it (FSDP2 + checkpoint)
                            held = self.weights.fsdp.uses.get((again.part.op, again.part.index))
                            if held:
                                self.weights.fsdp.unshard(held)
                            self._regraph(again)
                            if held:
                                self.weights.fsdp.reshard(held, backward=False)
                        self._regather(r)
                    for i in r.grad_calls if backward else r.calls:
                        self._call(i, backward)
                    gathered = self.weights.fsdp.uses.get((r.part.op, r.part.index))  # level-3 weights it reads
                    if gathered:
                        self.weights.fsdp.unshard(gathered)
                    if backward:
                        self._backward(r)
                    else:
                        self._forward(r)
                    if gathered:
                        self.weights.fsdp.reshard(gathered, backward)
                    for i in self.lets_go.get(position, ()):
                        self._let_go(i)
                except ExecutorError:
                    raise
                except Exception as e:
                    p = r.part
                    raise ExecutorError(
                        f"rank {rank}: op {p.op!r} partition {p.index} micro-batch {p.microbatch} "
                        f"({'backward' if backward else 'forward'}): {type(e).__name__}: {e}") from e
                if events is not None:
                    events.append({"name": r.backward_name if backward else r.forward_name, "ph": "X",
                                   "cat": "backward" if backward else "forward", "pid": rank, "tid": 0,
                                   "ts": t0 * 1e6, "dur": (clock() - t0) * 1e6})
                for key in self.issues.get(position, ()):
                    t0 = clock()
                    self.weights.start_bucket(key, self.bucket_groups,
                                              [p.terms for p in self._riders().get(key, ())])
                    if events is not None:
                        events.append({"name": "gradient sync start", "ph": "X", "cat": "gradient sync",
                                       "pid": rank, "tid": 0, "ts": t0 * 1e6, "dur": (clock() - t0) * 1e6,
                                       "args": {"devices": list(key.devices), "dtype": key.dtype, "zero": key.zero}})
            t0 = clock()
            self._sync_grads()
            finite = self.scaler.unscale(self.weights.parameters()) if self.scaler is not None else True
            t1 = clock()
            loss = self._step_loss()
            self.p2p.flush()
            t2 = clock()
            if update and self.optimizer is not None and finite:  # fp16: a step with inf/nan is skipped
                self.optimizer.step()
                self.weights.gather_chunks(self.bucket_groups)  # sharded buckets (ZeRO): the updated chunks
            if update and self.scaler is not None:
                self.scaler.update(finite)
            t3 = clock()
            value = loss() / self.strategy.microbatches
            if events is not None:
                events += [{"name": name, "ph": "X", "cat": name, "pid": rank, "tid": 0, "ts": a * 1e6,
                            "dur": (b - a) * 1e6}
                           for name, a, b in (("gradient sync", t0, t1), ("loss", t1, t2), ("update", t2, t3),
                                              ("loss", t3, clock()))]
            return value
        finally:
            self._clear()

    def _divide_grads(self) -> None:
        """STEP with a dynamic C (m = 1, every rank a loss partition): wait for the loss's sum
        and divide every local gradient by C = Σ c_p (the seed was 1/m, not 1/(m·C)), after the
        gradient sync (1/C·Σ_r g_r = Σ_r g_r/C: the buckets start before C is known)."""
        for r, pending in self.sums.values():
            ls = r.loss_sum
            if ls.count is None and ls.gates is Gate.STEP:
                count = pending.wait()[1]
                for t in self.weights.grad_holders():
                    if t.grad is not None:
                        t.grad.div_(count)

    def _riders(self) -> dict[BucketKey, list[BucketSum]]:
        """The loss sums that ride a bucket, in (op, micro-batch) order (every member of a
        bucket holds one partition of each such sum: its devices are the bucket's); all known
        once this rank's forwards have run, before its last backward pass."""
        riding = sorted((r.part.op, r.part.microbatch, r.id) for r, p in self.sums.values()
                        if isinstance(p, BucketSum))
        riders: dict[BucketKey, list[BucketSum]] = {}
        for _, _, i in riding:
            r, pending = self.sums[i]
            riders.setdefault(r.loss_sum.bucket, []).append(pending)
        return riders

    def _sync_grads(self) -> None:
        """The gradient sync (``LocalWeights.sync_grads``): the buckets not started yet
        started with their riding loss sums, every bucket waited, then the division by a
        dynamic C."""
        riders = self._riders()
        sums = self.weights.sync_grads(self.bucket_groups, {k: [p.terms for p in ps] for k, ps in riders.items()})
        for key, pendings in riders.items():
            for pending, total in zip(pendings, sums[key]):
                pending.value = total
        self._divide_grads()

    def _step_loss(self) -> Callable[[], float]:
        """Σ_j S_j / C_j of the micro-batches this rank counts (float64: each term is exactly a
        double), summed over the world when some rank holds no loss partition: that all-reduce
        is started here and waited by the returned call, which ``step`` makes after the
        optimizer update (nothing in it reads the value), so the two overlap. Every sum this
        rank started is waited here, counted or not (its buffers live until it is done)."""
        loss = sum(v.item() for v in self.losses)
        for r, pending in self.sums.values():
            total = pending.wait()
            if r.loss:
                loss += (total[0] / (r.loss_sum.count if r.loss_sum.count is not None else total[1])).item()
        if self.loss_everywhere:
            return lambda: loss
        total = torch.tensor([loss], dtype=torch.float64, device=self.device)
        work = dist.all_reduce(total, async_op=True)

        def value() -> float:
            work.wait()
            return total.item()
        return value

    # --- forward ------------------------------------------------------------------------------
    def _forward(self, r: Recipe) -> None:
        kind = r.node.kind
        if kind in WEIGHT_KINDS:
            return  # consumers read their own replica of it
        if kind == "input":
            out = self.batch[r.node.attrs["index"]][r.box]
        elif r.recompute:  # no autograd graph: nothing saved for backward (torch.utils.checkpoint)
            with torch.no_grad():
                inputs, _ = self._inputs(r, leaves=False)
                out = self._run(r, inputs)
            self.saved[r.id] = tuple(x if keep else None for x, keep in zip(inputs, r.keeps))
        elif r.id in self.guarded:
            self.saved_storages[r.id] = seen = SavedStorages(regathered(r.slots, self.lives, self.shared), self.shared)
            with seen.hooks():
                inputs, self.leaves[r.id] = self._inputs(r)
                out = self._run(r, inputs)
        else:
            inputs, self.leaves[r.id] = self._inputs(r)
            out = self._run(r, inputs)
        self.outs[r.id] = out
        if r.loss and r.loss_sum is None:
            self.losses.append(out.detach())
        if r.sends:  # in the lowering's dtype (mixed precision: the compute dtype)
            data = to_wire(out.detach(), getattr(torch, r.node.output.dtype))
            for s in r.sends:
                self.p2p.send(data if s.src is None else data[s.src], s.peer, s.transfer, backward=False)
        for i in r.frees:  # dropped or transient outputs whose last reader here has run
            if self.recipes[i].recompute:
                self.outs[i] = None
            else:
                self._release(i)

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

    def _run(self, r: Recipe, inputs: list[torch.Tensor | None]) -> torch.Tensor:
        """``r``'s partition computed from ``inputs`` and its weight views, under the plan's
        autocast (mixed precision; a plain call otherwise): the forward and a recomputation alike."""
        return self.autocast.run(r.node.kind, self.compute[r.id], inputs,
                                 {role: self.weights.view(name, index) for role, name, index in r.weights})

    def _compute(self, r: Recipe, group: Group | None, shards: ClassShards) -> Callable | None:
        """``(inputs, weights) -> output`` of ``r``'s partition: its op rule's forward with the
        reduce of its group (a loss's: and its class shards' collectives), or norm.batch_norm
        for a training batchnorm; None for a weight or an input."""
        node = r.node
        if node.kind in (*WEIGHT_KINDS, "input"):
            return None
        if node.kind == "batchnorm2d" and uses_batch_stats(node):
            return partial(self._batch_norm, r, group)
        if r.loss_sum is not None:
            return partial(self._loss, r, group, shards)
        reduce = no_reduce if group is None else partial(all_reduce_sum, group=group)
        extra = {"shards": shards} if node.kind == "loss" else {}
        return partial(get_rule(node.kind).forward, node, r.part.box, reduce=reduce, **extra)

    def _loss(self, r: Recipe, group: Group | None, shards: ClassShards, inputs: list[torch.Tensor],
              weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """A loss partition (module docstring): s_p / C (static C) or s_p, its group's sum of
        [s_p, c_p] (of s_p alone for a static C) started, not waited, or left to ride its
        gradient bucket; a class cut's max and sum over its class shards first (``Loss.partial``)."""
        s, c = get_rule("loss").partial(r.node, r.part.box, inputs, weights, shards)
        terms = torch.stack([s.detach(), c]) if r.loss_sum.count is None else s.detach().reshape(1)
        if r.loss_sum.bucket is not None:
            self.sums[r.id] = (r, BucketSum(terms))
        else:
            self.sums[r.id] = (r, group.sum_async(terms) if group is not None else PendingSum(None, [terms]))
        return s / r.loss_sum.count if r.loss_sum.count is not None else s

    def _batch_norm(self, r: Recipe, group: Group | None, inputs: list[torch.Tensor],
                    weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """norm.batch_norm, counting the op's batches as torch's num_batches_tracked does."""
        if r.node.attrs["training"] and "running_mean" in weights:
            self.bn_steps[r.part.op] = self.bn_steps.get(r.part.op, 0) + 1
        return batch_norm(r.node, inputs[0], weights, group,
                          self.bn_base.get(r.part.op, 0) + self.bn_steps.get(r.part.op, 0))

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

    # --- backward -----------------------------------------------------------------------------
    def _backward(self, r: Recipe) -> None:
        if r.backward == SKIP:
            return
        out, self.outs[r.id] = self.outs[r.id], None
        self.saved_storages.pop(r.id, None)
        if r.backward == ROOT:
            grad = self._output_grad(r, out)
            if out.requires_grad:
                torch.autograd.backward(out.edge if isinstance(out, Released) else out, grad)
        leaves = self.leaves[r.id]
        for s in r.grad_sends:
            leaf = leaves[s.slot] if leaves is not None else None
            g = leaf.grad if leaf is not None else None
            if g is None:
                g = torch.zeros(s.shape, dtype=s.dtype, device=self.device)
            self.p2p.send(to_wire(g if s.src is None else g[s.src], s.dtype), s.peer, s.transfer, backward=True)

    def _output_grad(self, r: Recipe, out: torch.Tensor | Released) -> torch.Tensor:
        """The seed of a partition of the graph's output (module docstring: 1/m, or 1/(m·C_j)
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

    # --- results ------------------------------------------------------------------------------
    def gradients(self) -> dict[str, torch.Tensor] | None:
        """Every trainable weight's gradient of the last step as a full tensor, on rank 0."""
        return self.weights.gather(grads=True)

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model state_dict on rank 0 (None elsewhere): every shard written into a
        full tensor, batchnorm step counts included; loadable with ``model.load_state_dict``."""
        values = self.weights.gather()
        counts = {}
        for node in self.graph:
            name = _batches_tracked(node)
            if name is None:
                continue
            owner = min(p.device for p in self.lowered.partitions[node.name][0])
            t = torch.tensor(self.bn_steps.get(node.name, 0) if self.rank == owner else 0,
                             dtype=torch.int64, device=self.device)
            dist.reduce(t, dst=0)
            counts[name] = t
        if self.rank != 0:
            return None
        out = dict(self.base)
        for name, t in list(values.items()) + list(counts.items()):
            base = out.get(name)
            out[name] = (t + base if name in counts and base is not None else t).to("cpu")
        out.update({alias: out[name] for alias, name in self.tied.items() if name in out})
        return out
