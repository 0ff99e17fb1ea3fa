"""The ``zero1`` and ``fsdp`` baselines: data parallel's cuts with every weighted op whose shards
have replicas at ZeRO level 1 / 3 (and only those), valid plans, written by ``plan --baseline``
as plan JSON version 6; ``strategies.replicas`` counts the replicas."""

import json

import pytest

from soapsearch.cli import main
from strategies import BASELINES, ParallelConfig, PlanError, baseline, data_parallel, read_plan
from strategies.baselines import fsdp, sharded, zero1
from strategies.replicas import shardable, weight_replicas
from strategies.strategy import Strategy
from tests.conftest import traced


@pytest.mark.parametrize("name", ["gpt", "mlp", "resnet101", "rnnlm", "llama"])
@pytest.mark.parametrize("kind,level", [("zero1", 1), ("fsdp", 3)])
def test_levels_on_every_replicated_weighted_op_and_only_there(name, kind, level):
    g = traced(name)
    for n in (2, 4):
        plan, dp = baseline(kind, g, n), data_parallel(g, n)
        plan.validate(g)
        assert kind in BASELINES and plan.num_devices == n
        levels = set()
        for node in g:
            cfg = plan[node.name]
            assert (cfg.degrees, cfg.devices, cfg.recompute) == (dp[node.name].degrees, dp[node.name].devices, False)
            weighted = any(w.trainable for w in node.weights)
            want = level if weighted and weight_replicas(g, dp, node.name) > 1 else 0
            assert cfg.zero == want, (node.name, node.kind, cfg)
            levels.add(cfg.zero)
        assert levels == {0, level}  # weighted ops take the level, the others (reshapes, losses) do not


def test_replicas_count_the_devices_holding_a_shard():
    g = traced("gpt")
    dp = data_parallel(g, 4)
    assert weight_replicas(g, dp, "blocks_0_mlp_fc") == 4  # data parallel: every device holds it
    assert weight_replicas(g, dp, next(n.name for n in g if n.kind == "add")) == 0  # no weight
    fc = g["blocks_0_mlp_fc"]
    out = len(fc.output.shape) - 1
    tp = dp.replace(fc.name, ParallelConfig(
        tuple(2 if i in (fc.sample_dim, out) else 1 for i in range(len(fc.dims))), (0, 1, 2, 3)))
    assert weight_replicas(g, tp, fc.name) == 2  # sample 2 x out_features 2: each column shard twice
    whole = dp.replace(fc.name, ParallelConfig((1,) * len(fc.dims), (0,)))
    assert weight_replicas(g, whole, fc.name) == 1 and not shardable(g, whole, fc.name)
    assert sharded(whole, g, 3)[fc.name].zero == 0  # a shard held by one device: no level
    wpe = next(n.name for n in g if n.kind == "parameter")  # read by its consumers on every device
    assert weight_replicas(g, dp, wpe) == 4 and fsdp(g, 4)[wpe].zero == 3


def test_one_device_has_nothing_to_shard():
    g = traced("mlp")
    assert all(cfg.zero == 0 for _, cfg in fsdp(g, 1).items())
    assert all(cfg.zero == 0 for _, cfg in zero1(g, 1).items())


def test_bad_counts_are_refused_in_one_line():
    g = traced("mlp")
    with pytest.raises(PlanError, match=r"batch 4 is not divisible by 3 devices x 1 micro-batches = 3"):
        fsdp(g, 3)
    with pytest.raises(PlanError, match="num_devices = 0: must be a whole number >= 1"):
        baseline("zero1", g, 0)


def test_sharded_keeps_the_plan_s_schedule_and_precision():
    g = traced("gpt")
    plan = data_parallel(g, 2).with_microbatches(2, "1f1b").with_precision("bf16")
    out = sharded(plan, g, 2)
    assert isinstance(out, Strategy)
    assert (out.microbatches, out.schedule, out.precision) == (2, "1f1b", "bf16")
    assert {cfg.zero for _, cfg in out.items()} == {0, 2}


@pytest.mark.parametrize("kind,level", [("fsdp", 3), ("zero1", 1)])
def test_cli_plan_baseline_writes_version_4_with_the_level(tmp_path, capsys, kind, level):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--variant", "tiny", "--baseline", kind, "--devices", "4", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f" zero{level}" in said and f"wrote {kind} plan" in said
    obj = json.loads(out.read_text())
    assert obj["version"] == 6 and obj["fsdp_unit"] == ("block" if kind == "fsdp" else "op")
    g = traced("gpt")
    ops = {o["name"]: o for o in obj["ops"]}
    assert ops["blocks_0_mlp_fc"]["zero"] == level and ops["blocks_0_mlp_fc"]["recompute"] is False
    assert all(ops[n.name]["zero"] == 0 for n in g if not any(w.trainable for w in n.weights))
    assert read_plan(out, g).strategy == baseline(kind, g, 4)


@pytest.mark.parametrize("kind", ["fsdp", "megatron", "data_parallel"])
def test_recompute_marks_every_op_of_every_block_and_nothing_else(kind):
    from strategies.megatron import megatron_blocks
    g = traced("gpt")
    plan = baseline(kind, g, 2, recompute=True)
    plan.validate(g)
    inside = {op for cols, mid, row in megatron_blocks(g) for op in (*cols, *mid, row)}
    assert len(inside) >= 20 and "blocks_0_attn_q" in inside and "blocks_1_mlp_proj" in inside
    assert {op for op, cfg in plan.items() if cfg.recompute} == inside
    plain = baseline(kind, g, 2)
    assert all(cfg.with_memory(recompute=False) == plain[op] for op, cfg in plan.items())


def test_recompute_without_a_block_is_refused_in_one_line(tmp_path, capsys):
    from tests.conftest import cli_error
    with pytest.raises(PlanError, match="recompute = True: model 'resnet101' has no linear → attention → linear"):
        baseline("data_parallel", traced("resnet101"), 2, recompute=True)
    line = cli_error(capsys, ["plan", "resnet101", "--variant", "tiny", "--baseline", "fsdp", "--devices", "2",
                              "--recompute", "-o", str(tmp_path / "p.json")])
    assert "recompute = True" in line


def test_cli_plan_fsdp_with_recompute(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--variant", "tiny", "--baseline", "fsdp", "--devices", "2", "--recompute",
                 "-o", str(out)]) == 0
    assert " zero3 recompute" in capsys.readouterr().out
    ops = {o["name"]: o for o in json.loads(out.read_text())["ops"]}
    assert ops["blocks_0_mlp_fc"]["recompute"] is True and ops["blocks_0_ln_1"]["recompute"] is False


def test_show_plan_prints_the_level_and_recompute(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--variant", "tiny", "--baseline", "fsdp", "--devices", "2", "--recompute",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["show-plan", str(out)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["blocks_0_mlp_fc"].endswith("@ 0-1 zero3 recompute")
    assert lines["blocks_0_ln_1"].endswith("@ 0-1 zero3") and lines["inputs"].endswith("@ 0-1")


def test_cli_plan_fsdp_unit_op(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--variant", "tiny", "--baseline", "fsdp", "--devices", "2", "--fsdp-unit", "op",
                 "-o", str(out)]) == 0
    assert json.loads(out.read_text())["fsdp_unit"] == "op"
    assert read_plan(out, traced("gpt")).strategy == baseline("fsdp", traced("gpt"), 2).with_fsdp_unit("op")
