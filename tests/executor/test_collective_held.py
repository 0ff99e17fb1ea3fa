"""What a rank holds of its collectives' buffers equals the memory model's walk of them
(``strategies.collective_buffers``, ``simulator.memory_collectives``): at the end of every step
of a sequence-parallel megatron plan on 2 gloo processes, the storages of what each call left
the rank (its entry and its readers' leaf copies, once each) and its readers' input gradients
are counted; their most over the step equals the model's peak of the collective rows alone,
max((w − 1)·K + r_f, w·K + r_b): every layer recomputed (its all-gathers gathered again in the
backward), and the attention cores recomputed with 4 micro-batches in 1F1B (w = 1 < m: each
micro-batch's kept results are let go after its backward, not at the step's end; the
reduce-scatters' chunks after their dropouts' forward; the linears' all-gathers after their
forward, gathered again at their backward, autograd saving the call to come:
``release.SavedStorages``)."""

from __future__ import annotations

import pytest
import torch

from simulator.memory_walks import _positions, _rises, device_warmups
from simulator.memory_collectives import collective_rows
from soapsearch.executor import Executor, TrainConfig, build_model
from strategies.collective_buffers import buffer_lives
from strategies.lowering import lower
from tests.executor.gloo import gloo_group, spawn_ranks
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

PLANS = ("megatron_sp+rc_layers", "megatron_sp_mb4+rc_attn")


class Counted(Executor):
    """An executor that counts its collectives' buffers at the end of every forward and
    backward step, before what it lets go after the step (``most``: their largest sum)."""

    most = 0

    def _forward(self, r) -> None:
        super()._forward(r)
        self._count()

    def _backward(self, r) -> None:
        super()._backward(r)
        self._count()

    def _count(self) -> None:
        storages: dict[int, int] = {}
        grads = 0
        for t in self.shared.values():
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        for reads in self.collective_readers.values():
            for task, slot in reads:
                leaf = self.leaves[task][slot] if self.leaves[task] is not None else None
                if leaf is None:
                    continue
                if leaf.grad is not None:
                    grads += leaf.grad.numel() * leaf.grad.element_size()
                if any(leaf.stride()):  # a hollowed leaf is one zero expanded: it holds nothing
                    storages[leaf.untyped_storage().data_ptr()] = leaf.untyped_storage().nbytes()
        self.most = max(self.most, sum(storages.values()) + grads)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world, port):
        built = build_model("gpt", "tiny", dtype="float64")
        got = {}
        for name in PLANS:
            ex = Counted(built.graph, make_plan(built.graph, name, world), built.state, built.inputs,
                         TrainConfig("sgd", lr=0.05, timeout_s=60))
            ex.step(seed=1)
            got[name] = ex.most
        torch.save(got, f"{out_dir}/{rank}.pt")


def _model_peaks(low) -> list[int]:
    """Per device, the collective rows' own peak over its run order."""
    n = low.strategy.num_devices
    held, freed, redone, gone = collective_rows(low, _positions(low.graph), n)
    kept = (held.sum(axis=0) - freed.sum(axis=0)).tolist()
    rise_f, rise_b = (x.tolist() for x in _rises(held, freed, redone, gone))
    ws = device_warmups(low)
    return [max((ws[d] - 1) * kept[d] + rise_f[d], ws[d] * kept[d] + rise_b[d]) for d in range(n)]


def test_each_rank_holds_the_modelled_collective_buffers():
    held = spawn_ranks(_worker, 2)
    g = build_model("gpt", "tiny", dtype="float64").graph
    lows = [lower(g, make_plan(g, name, 2)) for name in PLANS]
    lives = [buffer_lives(low, microbatch=0) for low in lows]
    # between them: results kept, gathered again (every layer recomputed), transient (a
    # reduce-scatter's chunk read by a dropout that does not recompute), w = 1 < m = 4
    assert all(any(x.kept for x in ls) for ls in lives)
    assert [any(x.regather for x in ls) for ls in lives] == [True, True]
    # the linears' all-gathers: gathered again at the backward of their last reader, which keeps the shard
    assert {x.regather for x in lives[1] if x.regather} >= {"blocks_0_attn_v", "blocks_0_mlp_fc"}
    assert any(not x.kept and x.regather is None for x in lives[1])
    assert lows[1].strategy.microbatches == 4 and device_warmups(lows[1]) == {0: 1, 1: 1}
    for name, low in zip(PLANS, lows):
        want = _model_peaks(low)
        assert [h[name] for h in held] == want, (name, want)
        assert min(want) > 0
