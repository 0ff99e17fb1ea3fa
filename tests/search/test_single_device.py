"""The one-device plan (issue 23): every op whole on device 0, a baseline where it fits — in
the search's closing table and ``--json``, and ``plan --baseline single_device``."""

import json

import pytest

from soapsearch.cli import main
from soapsearch.search import search
from strategies import PlanError, baseline, load_strategy
from tests.conftest import traced


def test_single_device_plan_is_every_op_whole_on_device_0():
    g = traced("mlp")
    plan = baseline("single_device", g, 4)
    assert plan.num_devices == 4 and plan.devices_used == (0,)
    assert all(cfg.devices == (0,) and set(cfg.degrees) == {1} for _, cfg in plan.items())
    with pytest.raises(PlanError, match=r"num_devices = 0: must be a whole number >= 1"):
        baseline("single_device", g, 0)


def test_search_scores_it_where_it_fits_and_not_where_it_does_not():
    g = traced("mlp")
    r = search(g, topology="p100-1x2", budget_s=None, proposals=10)
    assert r.baselines["single_device"] == pytest.approx(r.baseline_results["single_device"].iteration_ms)
    assert r.baseline_plans["single_device"].devices_used == (0,)
    assert r.predicted_ms <= r.baselines["single_device"]
    # GPT-2 small at batch 20 with Adam: 18.0 GiB on one device, over a 16 GB P100; data
    # parallel over the two halves it (10.2 GiB)
    big = traced("gpt", "default", 20)
    r = search(big, topology="p100-1x2", budget_s=None, proposals=2, optimizer="adam", zero_move=0,
               recompute_move=0, microbatch_move=0)
    assert "single_device" not in r.baselines and "data_parallel" in r.baselines


def test_cli_table_json_and_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--budget", "0",
                 "--proposals", "20", "--workers", "1", "-o", str(out), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["baselines"]["single_device"] >= obj["iteration_ms"]
    assert main(["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--budget", "0",
                 "--proposals", "20", "--workers", "1", "-o", str(out)]) == 0
    assert "\nsingle_device " in capsys.readouterr().out
    one = tmp_path / "one.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--baseline", "single_device",
                 "-o", str(one)]) == 0
    assert load_strategy(one, traced("mlp")).devices_used == (0,)
