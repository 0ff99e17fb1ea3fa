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

The step's loss (``step_loss.StepLoss``), what a partition reads (``reads.Reads``), one
partition's forward and backward (``partition_steps.PartitionSteps``) and what is let go and
recomputed (``recompute.Recompute``) are the Executor's parts in their own files.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import P2P, BucketSum, PendingSum, ProcessGroups, class_shards
from soapsearch.executor.config import TrainConfig, make_optimizer
from soapsearch.executor.errors import ExecutorError, check_runnable
from soapsearch.executor.partition_steps import PartitionSteps
from soapsearch.executor.precision import Autocast, LossScaler
from soapsearch.executor.reads import Reads
from soapsearch.executor.recipe import Recipe, receives_ahead, recipes
from soapsearch.executor.recompute import Recompute
from soapsearch.executor.release import Released, SavedStorages, collective_releases
from soapsearch.executor.shards import LocalWeights
from soapsearch.executor.step_loss import StepLoss
from strategies.collective_buffers import buffer_lives
from strategies.graph import OpGraph
from strategies.lowering import BucketKey, loss_on_every_device, lower
from strategies.overlap import bucket_issues, bucket_order
from strategies.prefetch import call_key, calls_at, step_units
from strategies.rules.cross_entropy import LOCAL
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


def _storage_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _batches_tracked(node) -> str | None:
    """The state_dict name of a batchnorm's num_batches_tracked (None: it tracks none)."""
    rm = node.weight("running_mean") if node.kind == "batchnorm2d" else None
    return rm.name.removesuffix("running_mean") + "num_batches_tracked" if rm is not None else None


class Executor(PartitionSteps, Reads, Recompute, StepLoss):
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
        """Recipes whose outputs no backward reads (``strategies.drops.transient``): let go
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
                issued = self.issues.get(position, ())
                if issued and not self.strategy.overlap_grad_reduce:  # after the backward and its sends
                    p2p.wait_sends()  # (strategies.overlap: Megatron-LM's schedule waits them first)
                for key in issued:
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
