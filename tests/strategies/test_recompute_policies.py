"""Recompute policies (strategies/recompute_policies.py, ``strategies.baselines.RECOMPUTE``):
which ops each one recomputes, on zoo llama (linears without bias) and gpt (with), and
``plan --recompute POLICY``."""

import argparse
import json

import pytest
import torch
from torch import nn

from soapsearch import trace
from soapsearch.cli import main
from strategies import PlanError
from strategies.baselines import RECOMPUTE, baseline, data_parallel
from strategies.megatron_layers import layer_ops
from strategies.recompute_policies import attention_recomputed, op_recomputed, op_saved, runs_as_mm
from tests.conftest import traced


def _recomputed(plan) -> set[str]:
    return {name for name, cfg in plan.items() if cfg.recompute}


def test_op_policy_saves_each_layers_attention_and_its_odd_products():
    """torchtitan's count of a LLaMA block's ``aten.mm``: wq 1, wk 2, wv 3, wo 4, w1 5, w3 6, w2 7;
    the odd ones and the attention core are saved, every other op of the layer recomputed, the
    closing residual adds and the ops outside the layers kept."""
    g = traced("llama")
    layers = layer_ops(g)
    plan = op_recomputed(data_parallel(g, 2), g)
    for i, layer in enumerate(layers):
        attention = {n.name for n in g if n.name in layer and n.kind == "attention"}
        products = [n.name for n in g if n.name in layer and n.kind == "linear"]
        assert [p.rsplit("_", 1)[1] for p in products] == ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
        saved = attention | {f"blocks_{i}_attn_wq", f"blocks_{i}_attn_wv", f"blocks_{i}_mlp_w1", f"blocks_{i}_mlp_w2"}
        assert op_saved(g, layer) == saved and len(attention) == 1
        assert layer - _recomputed(plan) == saved
    assert _recomputed(plan) == set().union(*layers) - set().union(*(op_saved(g, x) for x in layers))


def test_a_linear_with_a_bias_is_no_mm():
    """gpt's linears have biases (``aten.addmm``, not on the list): only the attention is saved."""
    g = traced("gpt")
    assert not any(runs_as_mm(n) for n in g if n.kind == "linear" and n.name != "lm_head")
    for layer in layer_ops(g):
        assert {g[x].kind for x in op_saved(g, layer)} == {"attention"} and len(op_saved(g, layer)) == 1


class _Products(nn.Module):
    """x @ W (3-D by 2-D: one ``aten.mm``), then a batched product (``aten.bmm``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        a = x @ self.w
        return (a @ a.transpose(1, 2)).sum()


def test_a_matmul_is_an_mm_where_its_second_operand_is_2d():
    g = trace(_Products(), (torch.randn(2, 4, 8),))
    kinds = {n.name: runs_as_mm(n) for n in g if n.kind == "matmul"}
    assert sorted(kinds.values()) == [False, True], kinds


def test_policies_by_name():
    g = traced("llama")
    plan = data_parallel(g, 2)
    assert _recomputed(baseline("data_parallel", g, 2, recompute="layers")) == set().union(*layer_ops(g))
    selective = baseline("data_parallel", g, 2, recompute="selective")
    assert _recomputed(selective) == {n.name for n in g if n.kind == "attention"} == _recomputed(
        attention_recomputed(plan, g))
    assert _recomputed(baseline("data_parallel", g, 2, recompute=True)) == _recomputed(
        RECOMPUTE["blocks"](plan, g))
    assert not _recomputed(baseline("data_parallel", g, 2, recompute=False))
    with pytest.raises(PlanError, match="recompute = 'op'.*must be one of \\['blocks', 'layers', 'selective'\\]"):
        baseline("data_parallel", g, 2, recompute="op")
    mlp = traced("mlp")
    for policy in ("selective", "layers"):  # no attention; MLP blocks that pair into no layer
        with pytest.raises(PlanError, match="recompute"):
            baseline("data_parallel", mlp, 2, recompute=policy)


@pytest.mark.parametrize("policy", ["layers", "selective"])
def test_plan_cli_recompute_policy(tmp_path, policy):
    out = tmp_path / "p.json"
    assert main(["plan", "llama", "--variant", "tiny", "--baseline", "megatron", "--devices", "2",
                 "--recompute", policy, "-o", str(out)]) == 0
    ops = json.loads(out.read_text())["ops"]
    g = traced("llama")
    expected = _recomputed(RECOMPUTE[policy](data_parallel(g, 2), g))
    assert {op["name"] for op in ops if op["recompute"]} == expected and expected


def test_plan_cli_refuses_an_unknown_policy(capsys):
    """argparse refuses it: one "invalid choice" line (an ArgumentError where the tests make it raise)."""
    with pytest.raises((SystemExit, argparse.ArgumentError)) as refused:
        main(["plan", "llama", "--variant", "tiny", "--baseline", "megatron", "--devices", "2",
              "--recompute", "op", "-o", "p.json"])
    if refused.type is SystemExit:
        assert refused.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
    else:
        err = str(refused.value)
    assert "--recompute" in err and "invalid choice: 'op'" in err and "blocks" in err
