"""``strategies.baselines.megatron_lm``: the plan Megatron-LM runs GPT-3 175B with (T × P,
one sequence a micro-batch under 1F1B, sequence parallelism, every layer recomputed up to its
closing add, ZeRO-1, bf16), its flags read off the plan and its memory counted by hand."""

import pytest
import torch

from simulator.memory import memory_breakdown
from soapsearch import trace
from soapsearch._models.transformer import GPT, GPTConfig
from strategies import PlanError
from strategies.baselines import megatron_lm
from strategies.lowering import lower
from strategies.megatron_layers import layer_ops
from strategies.replicas import shardable

S, H, T, P, D = 16, 64, 2, 2, 4  # sequence, width, tensor, pipeline, data parallel: 16 devices


def _graph(layers: int, batch: int = 8):
    model = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=H, seq_len=S, vocab_size=64, dropout=0.0))
    tokens = torch.zeros(batch, S, dtype=torch.long)
    return trace(model, (tokens, tokens), name=f"gpt-{layers}")


@pytest.fixture(scope="module")
def graphs():
    return {layers: _graph(layers) for layers in (2, 4)}


def test_the_flags_megatron_lm_runs(graphs):
    g = graphs[4]
    plan = megatron_lm(g, T * P * D, T, P)
    assert (plan.num_devices, plan.microbatches, plan.schedule, plan.precision) == (16, 8 // D, "1f1b", "bf16")
    assert megatron_lm(g, 16, T, P, micro_batch=2).microbatches == 1  # two sequences a micro-batch
    layers = layer_ops(g)
    assert len(layers) == 4
    assert {op for op in plan if plan[op].recompute} == set().union(*layers)
    assert {op for op in plan if plan[op].zero} == {op for op in plan if shardable(g, plan, op)}
    assert {plan[op].zero for op in plan} == {0, 1}


def test_memory_by_hand(graphs):
    """ZeRO-1 (Rajbhandari et al. 2020 §5: K·Ψ/N_d): Adam's two float32 moments and the float32
    master are 12 bytes a parameter, 6 per bf16 weight byte, and a device keeps 1/N of them for
    each weight shard N devices hold (D data-parallel replicas; D·T for the LayerNorms cut on
    the sequence under sequence parallelism); full recompute keeps a
    layer's input, s·b·h/t values at 2 bytes under sequence parallelism, for each of the P
    micro-batches 1F1B's first stage holds (m = P here: one sequence each)."""
    low = {n: lower(g, megatron_lm(g, T * P * D, T, P)) for n, g in graphs.items()}
    mem = {n: memory_breakdown(lw, "adam") for n, lw in low.items()}
    shares = [0] * 16
    for w in low[4].weight_shards:
        assert w.trainable and len(w.devices) in (D, D * T) and w.nbytes % len(w.devices) == 0
        for d in w.devices:
            shares[d] += w.nbytes // len(w.devices)
    for b, share in zip(mem[4], shares):
        assert b.gradients == b.weights > 0
        assert b.optimizer_state + b.master_weights == 6 * share
    kept = {n: lw.device_bytes.kept for n, lw in low.items()}
    per_layer = S * 1 * H // T * 2
    # two more layers: one more on each stage, on all 16 devices
    assert [k4 - k2 for k2, k4 in zip(kept[2], kept[4])] == [per_layer] * 16
    first = range(T * D)  # stage 0's devices hold its warm-up micro-batches' layer inputs
    assert all(mem[4][d].activations - mem[2][d].activations == min(P, 8 // D) * per_layer for d in first)


def test_bad_input_is_one_line(graphs):
    g = graphs[2]
    with pytest.raises(PlanError, match=r"tp x pp.*3 x 2.*divides num_devices 16"):
        megatron_lm(g, 16, 3, 2)
    with pytest.raises(PlanError, match=r"micro_batch.*batch 8 is not divisible by 4 data-parallel replicas x 3"):
        megatron_lm(g, 16, T, P, micro_batch=3)
