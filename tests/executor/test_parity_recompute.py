"""Parity of recompute plans (docs/design.md, "Recompute"; Chen et al. 2016, Korthikanti et al.
2022; torchtitan's selective op checkpointing as per-op flags): recompute per op and per block (every op of a gpt transformer block), alone and with
tensor (Megatron-LM) and pipeline cuts fed micro-batches, on 2 and 4 gloo processes, float64,
SGD and Adam, against one device (``harness.compare``); and, on a world of one, that the
executor holds none of the dropped outputs between a forward and its backward and saves nothing
for backward in a recompute op's forward: what it holds is the model's kept bytes."""

from __future__ import annotations

import weakref

import pytest
import torch

from soapsearch.executor import Executor, TrainConfig, build_model
from soapsearch.executor.errors import ExecutorError, check_runnable
from simulator.memory import memory_breakdown
from strategies import data_parallel
from strategies.lowering import lower
from strategies.region import box_numel
from strategies.saved import aliases, mask_bytes, saved_extra
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.conftest import traced
from tests.executor.harness import parity_tests
from tests.executor.plans import make_plan, recompute, recompute_ops

pytestmark = pytest.mark.distributed

CASES_2 = [("mlp", "dp+rc_mid"), ("gpt", "dp+rc_blocks"), ("gpt", "megatron+rc_blocks"),
           ("gpt", "megatron_sp+rc_blocks"), ("gpt", "1f1b+rc_block0"), ("gpt", "gpipe+rc_mlp"),
           ("gpt", "heads+rc_attn"), ("gpt", "random_mb1+rc_seed1"), ("gpt", "megatron+rc_layers"),
           ("gpt", "megatron_sp+rc_seed3"), ("gpt", "megatron_sp_mb4+rc_layers"), ("llama", "megatron+rc_op")]
CASES_4 = [("gpt", "megatron_pp2+rc_blocks"), ("gpt", "megatron+rc_attn"), ("gpt", "1f1b+rc_blocks"),
           ("mlp", "stages_dp+rc_mid"), ("gpt", "colrow+rc_mlp"), ("gpt", "random_mb2+rc_seed2"),
           ("gpt", "megatron_sp_pp2+rc_layers"), ("gpt", "megatron_sp_pp2+rc_seed3"), ("llama", "1f1b+rc_op")]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)])
def test_the_plans_drop_outputs(world, cases):
    """Every case drops some output; between them: tensor cuts with collectives, pipelines
    with micro-batches, dropped outputs read from another device."""
    collectives = micro = False
    for model, plan in cases:
        low = lower(traced(model), make_plan(traced(model), plan, world))
        assert any(p.dropped for p in low.pieces.values()), (model, plan)
        collectives = collectives or bool(low.collectives)
        micro = micro or low.strategy.microbatches > 1
    assert collectives and micro


results2, results4, test_parity_2_processes, test_parity_4_processes = parity_tests(CASES_2, CASES_4)
test_parity_4_processes = pytest.mark.slow(test_parity_4_processes)  # the README's test command stays within CI's time; `pytest -m slow` runs them


class Watched(Executor):
    """An executor that records, at its first backward step, which partitions' outputs it
    holds and the storages of outputs still alive, and counts the tensors autograd saves for
    backward in each forward step. Every tensor that may hold an output's storage is watched by
    a weak reference: each output, each leaf copy and each tensor autograd saves (which autograd
    holds as packed: alive while its graph is)."""

    def _clear(self) -> None:
        super()._clear()
        self.held = getattr(self, "held", None)
        self.alive = getattr(self, "alive", None)
        self.saved_by: dict[bool, int] = getattr(self, "saved_by", {False: 0, True: 0})
        self.masks = getattr(self, "masks", 0)
        self.watched: list[tuple[weakref.ref, int]] = []
        self.packed: list[torch.Tensor] = []

    def _run(self, r, inputs):  # innermost, so its hooks see every saved tensor
        if getattr(self, "running", None) is not r:  # a recomputation: counted as no forward's
            return super()._run(r, inputs)

        def pack(t):
            self.saved_by[r.recompute] += 1
            if t.dtype == torch.bool:  # a dropout's mask
                self.masks += t.numel()
            self.packed.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return super()._run(r, inputs)

    def _forward(self, r) -> None:
        self.running = r
        super()._forward(r)
        self.running = None
        outs = {_ptr(t) for t in self.outs if isinstance(t, torch.Tensor)}  # alive: one address each
        for t in [*self.packed, self.outs[r.id], *(self.leaves[r.id] or ())]:
            if isinstance(t, torch.Tensor) and _ptr(t) in outs:
                self.watched.append((weakref.ref(t), _ptr(t)))
        self.packed.clear()

    def _backward(self, r) -> None:
        if self.held is None:
            self.held = {(x.part.op, x.part.index): self.outs[x.id] for x in self.recipes}
            self.alive = {p for ref, p in self.watched if ref() is not None and _ptr(ref()) == p}
        super()._backward(r)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("model,what", [("mlp", "mid"), ("gpt", "blocks"), ("gpt", "attn"), ("gpt", "layers")])
def test_the_executor_holds_what_the_model_keeps(world_of_one, model, what):
    """Data parallel on one device, one micro-batch: at the first backward step every forward
    has run and the dropped outputs are gone (no outputs are received), so the outputs held
    are the model's kept bytes (``DeviceBytes.kept``; a parameter op's output is the weight,
    not held by a partition) and none of the dropped; a recompute op's forward saves no tensor
    for backward (the others do); and the step equals the plan without recompute."""
    built = build_model(model, "tiny", dtype="float64")
    g = built.graph
    plan = recompute(data_parallel(g, 1), recompute_ops(g, what))
    low = lower(g, plan)
    ex = Watched(g, plan, built.state, built.inputs, TrainConfig("sgd", lr=0.05))
    loss = ex.step(seed=3)
    weights = {n.name for n in g if n.kind in ("parameter", "constant")}
    held = {op for (op, _), out in ex.held.items() if _nbytes(out)}
    dropped = {op for op, p in low.pieces.items() if p.dropped}  # recomputed or transient (never read back)
    assert dropped and not held & dropped
    # no output storage outlives the executor's references: a let-go one is freed
    assert ex.alive == {_ptr(out) for out in ex.held.values() if _nbytes(out)}
    assert held | dropped | weights == set(low.pieces)
    assert any(not low.pieces[op].recompute for op in dropped) or model == "mlp"  # a transient output let go
    nbytes = _storage_bytes(ex.held.values())  # a view's output is its input's storage: counted once
    masks = _extras(low, 0, mask_bytes)
    assert ex.masks == masks == (sum(n.output.numel for n in g if n.kind == "dropout" and not plan[n.name].recompute) if model == "gpt" else 0)
    # a reshape after a permute is a view where SDPA's kernel lays its output out as [b, s, heads,
    # d] (flash, CPU float32) and a copy where it does not (the math kernel, float64): the
    # model counts the view; the copies, after an attention's permute only, come besides
    copies = {op: _nbytes(ex.held[(op, 0)]) for op in held if g[op].kind == "reshape"
              and ex.held[(op, 0)].data_ptr() != getattr(_base(g, ex.held, op), "data_ptr", int)()}
    assert all(g[g[op].inputs[0]].kind == "permute" and g[g[g[op].inputs[0]].inputs[0]].kind == "attention"
               for op in copies), copies
    assert nbytes == low.device_bytes.kept[0] - _extras(low, 0) + sum(copies.values())
    assert all(ex.held[(op, 0)].grad_fn is None for op in recompute_ops(g, what) if op in held)
    assert ex.saved_by[True] == 0 and ex.saved_by[False] > 0
    plain = Executor(g, data_parallel(g, 1), built.state, built.inputs, TrainConfig("sgd", lr=0.05))
    assert loss == plain.step(seed=3)  # the forward is the same arithmetic; the backward sums
    for (k, a), b in zip(ex.gradients().items(), plain.gradients().values()):  # in another order (no links)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=lambda m: f"{k}: {m}")
    plain_kept = lower(g, data_parallel(g, 1)).device_bytes.kept[0]
    # mlp's mid relu saves its output only: recomputed, it keeps its input instead, as many bytes
    assert (low.device_bytes.kept[0] < plain_kept) == (model == "gpt") and memory_breakdown(low)[0].activations >= nbytes - sum(copies.values())


def _nbytes(out) -> int:
    """The bytes an output holds: none once let go (None, or a transient one's stand-in)."""
    return out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0


def _base(g, held, op):
    """The output a view op's output views: its nearest producer through views that is no view."""
    while aliases(g[op]):
        op = g[op].inputs[0]
    return held[(op, 0)]


def _storage_bytes(outs) -> int:
    """The bytes the outputs hold, a view of another output's data counted once (it starts at
    the same address and spans as many bytes; micro-batches' slices of one batch do not)."""
    return sum({(t.data_ptr(), _nbytes(t)): _nbytes(t) for t in outs if _nbytes(t)}.values())


def _extras(low, device: int, extra=saved_extra) -> int:
    """What the model keeps on ``device`` per micro-batch besides outputs (``strategies.saved``:
    dropout masks, norms' and attention's row statistics; ``extra``): autograd holds them, not
    the executor's outputs."""
    return sum(extra(low.graph[op], box_numel(part.output)) for op, p in low.pieces.items() if not p.recompute
               for part in p.partitions[0] if part.device == device)


def test_recompute_of_an_op_that_sums_across_devices_is_refused():
    g = traced("gpt")
    plan = recompute(data_parallel(g, 2), [g.outputs[0]])
    with pytest.raises(ExecutorError, match=r"^op 'cross_entropy': recompute = True: its partitions sum .* across "
                       r"devices \[0, 1\] in their forward"):
        check_runnable(lower(g, plan), 2)


def _held_worker(rank: int, world: int, port: int, model: str, plan_name: str, out_dir: str) -> None:
    """One rank of ``test_each_rank_holds_what_the_model_keeps``: the bytes it holds at its
    first backward step, saved to ``out_dir``."""
    import math
    from strategies.schedule import warmups
    with gloo_group(rank, world, port):
        built = build_model(model, "tiny", dtype="float64")
        plan = make_plan(built.graph, plan_name, world)
        ex = Watched(built.graph, plan, built.state, built.inputs, TrainConfig("sgd", lr=0.05))
        snapshot = {}

        def look() -> None:
            if not snapshot:  # every forward of the warm-up has run, dropped outputs let go
                outs = _storage_bytes(t for t in ex.outs if isinstance(t, torch.Tensor))
                kept = sum(x.numel() * x.element_size() for xs in ex.saved.values() for x in xs if x is not None)
                w = warmups(ex.lowered)[rank]  # the micro-batches whose forwards have run
                received = sum(math.prod(p.shape) * s.dtype.itemsize for q in ex.recipes
                               if not q.recompute and q.part.microbatch < w
                               and not aliases(q.node)  # a view of a received piece: its output, in outs
                               for s in q.slots if s is not None for p in s.pieces if p.peer is not None)
                snapshot.update(outs=outs, saved=kept, received=received)

        def first(method):  # the first backward step starts with a recomputation or a backward
            def call(r):
                look()
                method(r)
            return call
        ex._regraph, ex._backward = first(ex._regraph), first(ex._backward)
        ex.step(seed=1)
        torch.save(snapshot, f"{out_dir}/{rank}.pt")


@pytest.mark.parametrize("plan", ["gpipe+rc_mid", "1f1b+rc_blocks"])
def test_each_rank_holds_what_the_model_keeps(plan):
    """Two-stage pipelines, 2 micro-batches, on 2 gloo processes: at each rank's first backward
    step it holds its warm-up's w·K bytes (``DeviceBytes.kept``, w = ``warmups``): the outputs
    it keeps and the pieces recompute partitions keep for their recomputation (received from
    the other stage), none dropped, plus the pieces the other partitions received (held by
    their leaves or autograd graphs: counted from their shapes)."""
    from strategies.schedule import warmups
    model = "mlp" if "mid" in plan else "gpt"
    held = spawn_ranks(_held_worker, 2, model, plan)
    built = build_model(model, "tiny", dtype="float64")
    low = lower(built.graph, make_plan(built.graph, plan, 2))
    ws = warmups(low)
    assert any(p.dropped for p in low.pieces.values())
    for rank in range(2):
        got = held[rank]
        kept = low.device_bytes.kept[rank] - _extras(low, rank)
        assert got["outs"] + got["saved"] + got["received"] == ws[rank] * kept, (rank, got, ws[rank], kept)
    assert any(h["saved"] for h in held)  # a recompute op kept a received piece
