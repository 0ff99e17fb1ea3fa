"""``soapsearch plan MODEL --baseline megatron`` with --tp, --pp, --microbatches,
--virtual-stages and --sequence-parallel, each bad value refused in one line with the arithmetic, and
``search --init megatron``."""

import json

import pytest

from soapsearch.cli import main
from strategies import read_plan
from tests.conftest import cli_error, traced

GPT = ["gpt", "--variant", "tiny"]


def test_plan_megatron_with_every_flag(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *GPT, "--baseline", "megatron", "--devices", "4", "--tp", "2", "--pp", "2",
                 "--microbatches", "2", "--sequence-parallel", "--json", "-o", str(out)]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["baseline"], said["num_devices"], said["microbatches"]) == ("megatron", 4, 2)
    g = traced("gpt")
    plan = read_plan(out, g).strategy
    assert (plan.microbatches, plan.schedule) == (2, "1f1b")
    assert plan["blocks_0_attn_proj"].show(g["blocks_0_attn_proj"].dims) == "R2 @ 0-1"
    assert plan["blocks_1_mlp_proj"].show(g["blocks_1_mlp_proj"].dims) == "R2 @ 2-3"  # the second stage
    assert plan["blocks_0_ln_1"].degrees == (1, 2, 1)  # sequence parallel: d = 1, sequence 2 ways
    assert main(["plan", *GPT, "--baseline", "megatron", "--devices", "4", "-o", str(out)]) == 0
    plain = read_plan(out, g).strategy  # defaults: tp 2 (the heads), pp 1, 1 micro-batch, samples
    assert plain.microbatches == 1 and plain["blocks_0_ln_1"].degrees == (4, 1, 1)
    assert "1 micro-batch(es)" in capsys.readouterr().out


def test_plan_megatron_virtual_stages(tmp_path):
    """--virtual-stages 2: 4 stages of one block each, stage s on rank s mod 2, interleaved."""
    out = tmp_path / "plan.json"
    assert main(["plan", *GPT, "--baseline", "megatron", "--devices", "4", "--tp", "2", "--pp", "2",
                 "--microbatches", "4", "--virtual-stages", "2", "-o", str(out)]) == 0
    g = traced("gpt")
    plan = read_plan(out, g).strategy
    assert (plan.microbatches, plan.schedule) == (4, "interleaved")
    assert [plan[f"blocks_{i}_{b}_proj"].devices for i in (0, 1) for b in ("attn", "mlp")] == [
        (0, 1), (2, 3), (0, 1), (2, 3)]


@pytest.mark.parametrize("flags,says", [
    (["--devices", "4", "--tp", "2", "--pp", "3"],
     "pp = 3: 3 pipeline stages do not divide num_devices 4 (4 % 3 = 1)"),
    (["--devices", "8", "--tp", "8", "--pp", "2"], "tp x pp = 16: tp 8 x pp 2 = 16 does not divide num_devices 8"),
    (["--devices", "4", "--tp", "4"],
     "op 'scaled_dot_product_attention': tp = 4: the attention's 2 heads are not divisible by tp 4 (2 % 4 = 2)"),
    (["--devices", "2", "--microbatches", "3"],
     "microbatches = 3: batch 4 is not divisible by 3 micro-batches (4 % 3 = 1)"),
    (["--devices", "8", "--tp", "1", "--pp", "8"],
     "pp = 8: more pipeline stages than the model's 4 transformer blocks; give pp <= 4"),
    (["--devices", "2", "--pp", "0"], "pp = 0: must be a whole number >= 1"),
    (["--devices", "4", "--tp", "2", "--pp", "2", "--microbatches", "1", "--virtual-stages", "2"],
     "virtual_stages = 2: the interleaved schedule needs pp >= 2 and micro-batches a multiple of pp "
     "(pp 2, microbatches 1)"),
    (["--devices", "4", "--tp", "2", "--pp", "2", "--microbatches", "2", "--virtual-stages", "3"],
     "virtual_stages = 3: pp 2 x virtual_stages 3 = 6 stages but the model has 4 transformer blocks"),
])
def test_bad_megatron_flags(tmp_path, capsys, flags, says):
    line = cli_error(capsys, ["plan", *GPT, "--baseline", "megatron", *flags, "-o", str(tmp_path / "p.json")])
    assert line == f"soapsearch plan: error: {says}\n"


@pytest.mark.parametrize("flag", [["--tp", "2"], ["--pp", "2"], ["--sequence-parallel"], ["--virtual-stages", "2"]])
def test_megatron_flags_on_another_baseline(tmp_path, capsys, flag):
    line = cli_error(capsys, ["plan", *GPT, "--baseline", "owt", "--devices", "2", *flag,
                              "-o", str(tmp_path / "p.json")])
    assert line == f"soapsearch plan: error: {flag[0]} is a flag of --baseline megatron, not of --baseline owt\n"


def test_search_init_megatron(tmp_path, capsys):
    out = tmp_path / "found.json"
    assert main(["search", *GPT, "--topology", "p100-1x4", "--init", "megatron", "--proposals", "40",
                 "--workers", "1", "--json", "-o", str(out)]) == 0
    said = json.loads(capsys.readouterr().out)
    assert "megatron" in said["baselines"]
    assert said["iteration_ms"] <= min(said["baselines"].values())
    assert read_plan(out, traced("gpt")).strategy.num_devices == 4
