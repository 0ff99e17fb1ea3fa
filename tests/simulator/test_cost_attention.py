"""The attention kernels of the analytical model: "flash" keeps the scores on chip, "math" (Dao
et al. 2022, Algorithms 0 and 3) writes and reads the queries × keys scores in HBM; attention's
backward is twice its forward's FLOPs either way."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from simulator.cost import AnalyticalCostModel, partition_bytes, partition_flops
from simulator.devices import DeviceSpec
from soapsearch.trace import trace
from strategies.region import full_box

GPU = DeviceSpec("A100", 80 << 30, {"float32": 100e12}, 1e12)
LAUNCH = 5e-6


class Causal(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture(scope="module")
def attention():
    # batch 2, 4 heads, 256 queries and keys, head_dim 8: the scores outweigh q, k, v and out
    x = torch.randn(2, 4, 256, 8)
    return next(n for n in trace(Causal(), (x, x, x)) if n.kind == "attention")


def test_flash_moves_q_k_v_and_out_and_backward_is_twice_the_flops(attention):
    box = full_box(attention.shape)
    f, b = partition_flops(attention, box), partition_bytes(attention, box)
    fwd, bwd = AnalyticalCostModel(launch_overhead=LAUNCH).op_time(attention, box, GPU)
    assert fwd == pytest.approx(max(f / 60e12, b / 0.8e12) + LAUNCH)
    assert bwd == pytest.approx(max(2 * f / 60e12, 2 * b / 0.8e12) + LAUNCH)


def test_math_writes_and_reads_the_scores(attention):
    box = full_box(attention.shape)
    f, b = partition_flops(attention, box), partition_bytes(attention, box)
    scores = 2 * 4 * 256 * 256 * 4  # batch x heads x queries x keys, float32
    fwd, bwd = AnalyticalCostModel(launch_overhead=LAUNCH, attention="math").op_time(attention, box, GPU)
    assert fwd == pytest.approx(max(f / 60e12, (b + 4 * scores) / 0.8e12) + 3 * LAUNCH)
    assert bwd == pytest.approx(max(2 * f / 60e12, (2 * b + 7 * scores) / 0.8e12) + 5 * LAUNCH)
    assert fwd > 3 * AnalyticalCostModel(launch_overhead=LAUNCH).op_time(attention, box, GPU)[0]


def test_megatron_adds_the_dropout_on_the_probabilities(attention):
    """Megatron-LM's CoreAttention by hand: forward baddbmm writes S, the fused softmax reads S and
    writes P, dropout reads P and writes P' and a bool mask, bmm reads P': 6 passes over the
    scores, 1 mask byte a score, 4 kernels; backward reads P', writes dP', the dropout's backward
    reads dP' and the mask and writes dP, the softmax's reads dP and P and writes dS, dQ and dK
    read dS: 9 passes, the mask, 6 kernels."""
    box = full_box(attention.shape)
    f, b = partition_flops(attention, box), partition_bytes(attention, box)
    count = 2 * 4 * 256 * 256  # batch x heads x queries x keys
    scores = count * 4  # float32
    fwd, bwd = AnalyticalCostModel(launch_overhead=LAUNCH, attention="megatron").op_time(attention, box, GPU)
    assert fwd == pytest.approx(max(f / 60e12, (b + 6 * scores + count) / 0.8e12) + 4 * LAUNCH)
    assert bwd == pytest.approx(max(2 * f / 60e12, (2 * b + 9 * scores + count) / 0.8e12) + 6 * LAUNCH)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="attention 'xformers' must be one of"):
        AnalyticalCostModel(attention="xformers")
