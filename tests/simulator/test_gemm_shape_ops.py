"""Which product each op's rule hands the GPU shape model (``OpRule.gemm_shape``): a conv's
implicit GEMM (cuDNN), a recurrent cell's step product, so the K-form n½ serves every product."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from simulator.cost import gemm_efficiency
from simulator.gemm_shape import shape_efficiency
from simulator.presets import get_topology
from soapsearch.trace import trace
from strategies.region import full_box
from strategies.rules import get_rule

A100 = get_topology("a100-1x8").devices[0]


def _op(module: nn.Module, x: torch.Tensor, kind: str):
    return next(n for n in trace(nn.Sequential(module), (x,)) if n.kind == kind)


def test_a_convs_implicit_gemm_by_hand():
    # 64 → 128 channels, 3×3, 8 images of 28×28 out: [8·784, 64·9] × [64·9, 128]
    node = _op(nn.Conv2d(64, 128, 3, padding=1), torch.randn(8, 64, 28, 28), "conv2d")
    rule, box = get_rule(node.kind), full_box(node.shape)
    assert rule.gemm_shape(node, box) == (1, 8 * 784, 128, 64 * 9)
    assert gemm_efficiency(node, box, A100)[0] == pytest.approx(
        shape_efficiency(1, 8 * 784, 128, 576, A100), rel=1e-12)
    # a cut of the in channels (an R dim) shortens K; of the batch, M
    cut = (box[0], box[1], box[2], box[3], (0, 16))
    assert rule.gemm_shape(node, cut) == (1, 8 * 784, 128, 16 * 9)
    assert rule.gemm_shape(node, ((0, 2),) + box[1:]) == (1, 2 * 784, 128, 576)


def test_a_grouped_conv_runs_a_product_per_group():
    node = _op(nn.Conv2d(12, 24, 3, padding=1, groups=3), torch.randn(2, 12, 8, 8), "conv2d")
    rule, box = get_rule(node.kind), full_box(node.shape)
    assert rule.gemm_shape(node, box) == (3, 2 * 64, 8, 4 * 9)
    assert rule.gemm_shape(node, (box[0], (0, 16)) + box[2:]) == (2, 2 * 64, 8, 4 * 9)  # two whole groups
    assert rule.gemm_shape(node, (box[0], (0, 4)) + box[2:]) == (1, 2 * 64, 4, 4 * 9)  # half of one group
    depthwise = _op(nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.randn(2, 8, 8, 8), "conv2d")
    assert get_rule("conv2d").gemm_shape(depthwise, full_box(depthwise.shape)) is None
    assert gemm_efficiency(depthwise, full_box(depthwise.shape), A100) is None


@pytest.mark.parametrize("kind, cls, gates", [("lstm", nn.LSTM, 4), ("gru", nn.GRU, 3), ("rnn", nn.RNN, 1)])
def test_a_recurrent_steps_product_by_hand(kind, cls, gates):
    # batch 16, input 32, hidden 64: each step [16, 32 + 64] × [96, gates·64], one step at a time
    node = _op(cls(32, 64, batch_first=True), torch.randn(16, 10, 32), kind)
    rule, box = get_rule(kind), full_box(node.shape)
    assert rule.gemm_shape(node, box) == (1, 16, gates * 64, 96)
    assert rule.gemm_shape(node, ((0, 4),) + box[1:]) == (1, 4, gates * 64, 96)
    assert gemm_efficiency(node, box, A100)[0] == pytest.approx(
        shape_efficiency(1, 16, gates * 64, 96, A100), rel=1e-12)


def test_an_lstm_with_a_projection_carries_h_of_proj_size():
    node = _op(nn.LSTM(32, 64, proj_size=16), torch.randn(10, 8, 32), "lstm")
    assert get_rule("lstm").gemm_shape(node, full_box(node.shape)) == (1, 8, 256, 32 + 16)


def _linear(rows: int, fin: int, fout: int, trainable: bool):
    from strategies.graph import Dim, OpNode, TensorSpec, Weight
    return OpNode("fc", "linear", ("x",), TensorSpec((rows, fout), "bfloat16"),
                  (Dim("sample", rows, "sample"), Dim("out_features", fout, "parameter"),
                   Dim("in_features", fin, "reduction")),
                  weights=(Weight("weight", "fc.weight", TensorSpec((fout, fin), "bfloat16"), trainable),),
                  input_specs=(TensorSpec((rows, fin), "bfloat16"),), flops=2 * rows * fin * fout)


def test_backward_is_the_sum_over_the_gradients_computed_each_at_its_rate():
    """A frozen linear computes dX only (F at dA's rate); a trained one dX and dW; a matmul of two
    activations both operands' gradients (2F: dA at dA's rate, dB at dB's)."""
    from simulator.cost import AnalyticalCostModel
    from simulator.gemm_shape import backward_shapes
    model, peak = AnalyticalCostModel(), 312e12
    launch = model.launch(A100)
    for trainable in (False, True):
        node = _linear(8, 4096, 4096, trainable)
        d_a, d_w = (shape_efficiency(*s, A100) for s in backward_shapes(1, 8, 4096, 4096))
        _, back = model.op_time(node, full_box(node.shape), A100)
        want = node.flops / (peak * d_a) + (node.flops / (peak * d_w) + launch if trainable else 0)
        assert back == pytest.approx(want + launch, rel=1e-12)
    a, b = torch.randn(4, 256, 512, requires_grad=True), torch.randn(4, 512, 1024, requires_grad=True)

    class MatMul(nn.Module):
        def forward(self, x, y):
            return torch.matmul(x, y)
    mm = next(n for n in trace(MatMul(), (a, b)) if n.kind == "matmul")
    d_a, d_b = (shape_efficiency(*s, A100) for s in backward_shapes(4, 256, 1024, 512))
    _, back = model.op_time(mm, full_box(mm.shape), A100)
    peak = A100.flops_for(mm.output.dtype)  # traced in float32
    assert back == pytest.approx(mm.flops / (peak * d_a) + mm.flops / (peak * d_b) + 2 * launch, rel=1e-12)


def _matmul(a: torch.Tensor, b: torch.Tensor):
    class MatMul(nn.Module):
        def forward(self, x, y):
            return torch.matmul(x, y)
    return next(n for n in trace(MatMul(), (a, b)) if n.kind == "matmul")


def test_a_matmul_with_a_2d_operand_is_one_folded_product():
    """x[16, 128, 4096] @ W[4096, 4096]: torch.matmul runs one [2048, 4096] × [4096, 4096] GEMM,
    so dB is 4096 × 4096 over 2048 rows, not 16 products over 128."""
    node = _matmul(torch.empty(16, 128, 4096, device="meta"), torch.empty(4096, 4096, device="meta"))
    box = full_box(node.shape)
    assert get_rule("matmul").gemm_shape(node, box) == (1, 2048, 4096, 4096)
    assert get_rule("matmul").gemm_shape(node, ((0, 4),) + box[1:]) == (1, 512, 4096, 4096)
    assert gemm_efficiency(node, box, A100)[2] == pytest.approx(shape_efficiency(1, 4096, 4096, 2048, A100), rel=1e-12)
    size_one = _matmul(torch.empty(16, 128, 64, device="meta"), torch.empty(1, 64, 256, device="meta"))
    assert get_rule("matmul").gemm_shape(size_one, full_box(size_one.shape)) == (1, 2048, 256, 64)
    left = _matmul(torch.empty(128, 64, device="meta"), torch.empty(16, 64, 256, device="meta"))
    assert get_rule("matmul").gemm_shape(left, full_box(left.shape)) == (1, 128, 16 * 256, 64)
    both = _matmul(torch.empty(16, 128, 64, device="meta"), torch.empty(16, 64, 256, device="meta"))
    assert get_rule("matmul").gemm_shape(both, full_box(both.shape)) == (16, 128, 256, 64)
