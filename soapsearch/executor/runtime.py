"""One rank of a plan: forward and backward of its partitions in the schedule's fixed order,
the pieces the lowering says move, the gradient sync of replicated shards and the optimizer
step (DESIGN.md "Executor"). Nothing here re-derives a region: partitions, transfers, shards
and reductions all come from ``strategies.lowering.lower``; the order from
``strategies.schedule.device_order``.

Each partition keeps its own autograd graph, from leaf copies of its inputs (GPipe's
per-stage graphs, Huang et al. 2019): the gradient of a partition's output is the sum of the
gradient pieces its consumers send back, and ``autograd.backward(out, grad)`` fills its
inputs' ``.grad``, which go back to the producers. The loss op's partitions each return the
whole micro-batch loss L_j; the step's loss is (1/m)·Σ_j L_j, so each of the k partitions is
seeded with 1/(k·m), and the reduction's backward (a sum over the k) restores 1/m.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from soapsearch.executor.comm import P2P, ProcessGroups, all_reduce_sum
from soapsearch.executor.config import TrainConfig, make_optimizer
from soapsearch.executor.errors import ExecutorError, check_runnable
from soapsearch.executor.norm import update_running_stats
from soapsearch.executor.shards import LocalWeights
from strategies.graph import OpGraph
from strategies.lowering import WEIGHT_KINDS, Partition, Transfer, lower
from strategies.region import Box, box_shape, shift_box, slice_box
from strategies.rules import get_rule
from strategies.rules.pointwise import set_dropout_seed
from strategies.schedule import Step, device_order
from strategies.strategy import Strategy

__all__ = ["Executor"]

Key = tuple[str, int, int]  # (op, partition index, micro-batch)


def _cut(t: torch.Tensor, region: Box, origin: Box) -> torch.Tensor:
    return t[slice_box(shift_box(region, origin))]


class Executor:
    """Runs ``strategy`` on this rank (``dist`` must be initialized; rank = device). ``state``
    is the full model's state_dict (same seed on every rank), ``batch`` the model's positional
    inputs; each step trains on it."""

    def __init__(self, graph: OpGraph, strategy: Strategy, state: Mapping[str, torch.Tensor],
                 batch: Sequence[Any], config: TrainConfig = TrainConfig(),
                 device: torch.device | str = "cpu"):
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.lowered = lower(graph, strategy)
        check_runnable(self.lowered, world)
        self.graph, self.strategy, self.config = graph, strategy, config
        self.device = torch.device(device)
        self.batch = [b.to(self.device) if isinstance(b, torch.Tensor) else b for b in batch]
        self.base = {k: v.detach().clone() for k, v in state.items()} if self.rank == 0 else {}
        low = self.lowered
        self.order: list[Step] = device_order(low).get(self.rank, [])
        self.groups = ProcessGroups([r.devices for r in low.reductions]
                                    + [s.devices for s in low.weight_shards if s.trainable], world)
        self.weights = LocalWeights(low, state, self.rank, self.device)
        params = self.weights.parameters()
        self.optimizer = make_optimizer(params, config) if params else None
        self.p2p = P2P(len(low.transfers), config.timeout_s, self.rank)
        self.parts: dict[Key, Partition] = {(p.op, p.index, p.microbatch): p
                                            for per_mb in low.partitions.values() for ps in per_mb for p in ps}
        self.into: dict[Key, list[tuple[int, Transfer]]] = {}
        self.out_of: dict[Key, list[tuple[int, Transfer]]] = {}
        for i, t in enumerate(low.transfers):
            self.into.setdefault((t.dst_op, t.dst_index, t.microbatch), []).append((i, t))
            self.out_of.setdefault((t.src_op, t.src_index, t.microbatch), []).append((i, t))
        self.reduction = {(r.op, r.microbatch, k): r for r in low.reductions for k in r.partitions}
        self.needs_grad = self._needs_grad()
        self.bn_steps: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self._clear()

    # --- static facts ---------------------------------------------------------------------
    def _needs_grad(self) -> dict[str, bool]:
        """Whether an op's output carries a gradient: a floating output that depends on a
        trainable weight. Both ends of a transfer decide from this alone whether its gradient
        moves, so sends and receives always pair."""
        out: dict[str, bool] = {}
        for n in self.graph:
            floating = n.output.dtype.startswith(("float", "bfloat"))
            if n.kind == "input" or n.kind == "constant":
                out[n.name] = False
            elif n.kind == "parameter":
                out[n.name] = floating and any(w.trainable for w in n.weights)
            else:
                out[n.name] = floating and (any(w.trainable for w in n.weights)
                                            or any(out[s] for s in n.inputs))
        return out

    def _carries_grad(self, t: Transfer) -> bool:
        return self.needs_grad[t.src_op] and self.needs_grad[t.dst_op]

    def _clear(self) -> None:
        self.outs: dict[Key, torch.Tensor] = {}
        self.leaves: dict[Key, list[torch.Tensor | None]] = {}
        self.losses: list[torch.Tensor] = []

    # --- one step ---------------------------------------------------------------------------
    def step(self, seed: int = 0, update: bool = True) -> float:
        """One training iteration: every step of this rank's order, the gradient sync, the
        optimizer step (unless ``update`` is False); returns the step's loss on every rank."""
        set_dropout_seed(seed)  # this thread runs every forward: the masks of one device
        try:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            for s in self.order:
                t0 = time.perf_counter()
                try:
                    (self._backward if s.backward else self._forward)(self.parts[(s.op, s.index, s.microbatch)])
                except ExecutorError:
                    raise
                except Exception as e:
                    raise ExecutorError(
                        f"rank {self.rank}: op {s.op!r} partition {s.index} micro-batch {s.microbatch} "
                        f"({'backward' if s.backward else 'forward'}): {type(e).__name__}: {e}") from e
                self.events.append({"name": f"{'B' if s.backward else 'F'} {s.op}[{s.index}] mb{s.microbatch}",
                                    "ph": "X", "pid": self.rank, "tid": 0, "ts": t0 * 1e6,
                                    "dur": (time.perf_counter() - t0) * 1e6})
            self.weights.sync_grads(self.groups)
            loss = torch.zeros(1, dtype=torch.float64, device=self.device)
            for v in self.losses:
                loss += v.to(torch.float64)
            dist.all_reduce(loss)
            self.p2p.flush()
            if update and self.optimizer is not None:
                self.optimizer.step()
            return loss.item() / self.strategy.microbatches
        finally:
            self._clear()

    # --- forward ------------------------------------------------------------------------------
    def _forward(self, p: Partition) -> None:
        node = self.graph[p.op]
        key = (p.op, p.index, p.microbatch)
        if node.kind in WEIGHT_KINDS:
            return  # consumers read their own replica of it
        if node.kind == "input":
            out = self.batch[node.attrs["index"]][slice_box(p.box)]
        else:
            inputs: list[torch.Tensor | None] = []
            leaves: list[torch.Tensor | None] = []
            for slot, region in enumerate(p.input_regions):
                src = self.graph[node.inputs[slot]]
                x = None
                if region is not None and src.kind in WEIGHT_KINDS:
                    x = self.weights.view(src.weights[0].name, region)
                elif region is not None:
                    x = self._gather(p, slot, region)
                    if self.needs_grad[src.name] and self.needs_grad[p.op]:
                        x = x.detach().requires_grad_()
                        leaves.append(x)
                        inputs.append(x)
                        continue
                inputs.append(x)
                leaves.append(None)
            weights = {role: self.weights.view(node.weight(role).name, region)
                       for role, region in p.weight_regions}
            record: list[torch.Tensor] = []
            out = get_rule(node.kind).forward(node, p.box, inputs, weights, self._reducer(p, record))
            if node.kind == "batchnorm2d":
                self.bn_steps[p.op] = self.bn_steps.get(p.op, 0) + 1
                update_running_stats(node, p.box, record, self.weights, self.bn_steps[p.op])
            self.leaves[key] = leaves
        self.outs[key] = out
        if p.op in self.graph.outputs and p.index == 0:
            self.losses.append(out.detach())
        for i, t in self.out_of.get(key, ()):
            if not t.local:
                self.p2p.send(_cut(out.detach(), t.region, p.box), t.dst_device, i, backward=False)

    def _reducer(self, p: Partition, record: list[torch.Tensor]):
        group = self.reduction.get((p.op, p.microbatch, p.index))
        pg = self.groups.get(group.devices) if group is not None else None

        def reduce(t: torch.Tensor) -> torch.Tensor:
            y = all_reduce_sum(t, pg) if pg is not None else t
            record.append(y.detach())
            return y
        return reduce

    def _gather(self, p: Partition, slot: int, region: Box) -> torch.Tensor:
        """Input ``slot`` of ``p``: its pieces from local outputs or received from their ranks."""
        pieces = [(i, t) for i, t in self.into.get((p.op, p.index, p.microbatch), ()) if t.slot == slot]
        src = self.graph[p.op].inputs[slot]
        dtype = getattr(torch, self.graph[src].output.dtype)
        if len(pieces) == 1 and pieces[0][1].local and pieces[0][1].region == region:
            t = pieces[0][1]
            return _cut(self.outs[(src, t.src_index, p.microbatch)].detach(), region,
                        self.parts[(src, t.src_index, p.microbatch)].box)
        buf = torch.empty(box_shape(region), dtype=dtype, device=self.device)
        for i, t in pieces:
            if t.local:
                skey = (src, t.src_index, p.microbatch)
                piece = _cut(self.outs[skey].detach(), t.region, self.parts[skey].box)
            else:
                piece = self.p2p.recv(box_shape(t.region), dtype, self.device, t.src_device, i, False,
                                      f"output of op {src!r} partition {t.src_index} (micro-batch "
                                      f"{p.microbatch}) for op {p.op!r} partition {p.index}")
            buf[slice_box(shift_box(t.region, region))] = piece
        return buf

    # --- backward -----------------------------------------------------------------------------
    def _backward(self, p: Partition) -> None:
        node = self.graph[p.op]
        key = (p.op, p.index, p.microbatch)
        if node.kind in WEIGHT_KINDS or node.kind == "input" or not self.needs_grad[p.op]:
            return
        out = self.outs.pop(key)
        if p.op in self.graph.outputs:
            k = len(self.lowered.partitions[p.op][p.microbatch])
            grad = torch.full_like(out, 1.0 / (k * self.strategy.microbatches))
        else:
            grad = torch.zeros(box_shape(p.box), dtype=out.dtype, device=self.device)
            for i, t in self.out_of.get(key, ()):
                if not self._carries_grad(t):
                    continue
                where = slice_box(shift_box(t.region, p.box))
                if t.local:
                    dkey = (t.dst_op, t.dst_index, p.microbatch)
                    leaf = self.leaves[dkey][t.slot]
                    if leaf is not None and leaf.grad is not None:
                        grad[where] += _cut(leaf.grad, t.region, self.parts[dkey].input_regions[t.slot])
                else:
                    grad[where] += self.p2p.recv(
                        box_shape(t.region), out.dtype, self.device, t.dst_device, i, True,
                        f"gradient for op {p.op!r} partition {p.index} (micro-batch {p.microbatch}) "
                        f"from op {t.dst_op!r} partition {t.dst_index}")
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        leaves = self.leaves.get(key, [])
        for i, t in self.into.get(key, ()):
            if t.local or not self._carries_grad(t):
                continue
            region = p.input_regions[t.slot]
            leaf = leaves[t.slot]
            g = leaf.grad if leaf is not None and leaf.grad is not None else None
            if g is None:
                g = torch.zeros(box_shape(region), dtype=getattr(torch, self.graph[t.src_op].output.dtype),
                                device=self.device)
            self.p2p.send(_cut(g, t.region, region), t.src_device, i, backward=True)

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
            rm = node.weight("running_mean")
            if node.kind != "batchnorm2d" or rm is None:
                continue
            name = rm.name.removesuffix("running_mean") + "num_batches_tracked"
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
        return out
