"""A plan's precision (docs/design.md, "Mixed precision"): the Strategy field, plan JSON version 2
(version 1 loads as "model"), bad values refused in one line, the CLI's --dtype reaching the
plan, the simulator and the search."""

import argparse
import json

import pytest

from soapsearch.cli import main
from soapsearch.search import SearchConfig
from strategies import PlanError, baseline, load_strategy, read_plan, save_strategy
from strategies.strategy import Strategy
from tests.conftest import traced


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp")


@pytest.mark.parametrize("precision", ["model", "bf16", "fp16"])
def test_round_trip_keeps_the_precision(tmp_path, mlp, precision):
    plan = baseline("data_parallel", mlp, 2).with_precision(precision)
    save_strategy(tmp_path / "p.json", plan, mlp)
    obj = json.loads((tmp_path / "p.json").read_text())
    assert obj["version"] == 6 and obj["precision"] == precision
    assert read_plan(tmp_path / "p.json", mlp).strategy == plan
    assert plan.compute_dtype == {"model": None, "bf16": "bfloat16", "fp16": "float16"}[precision]


def test_a_version_1_plan_loads_as_model_precision(tmp_path, mlp):
    plan = baseline("data_parallel", mlp, 2)
    save_strategy(tmp_path / "p.json", plan.with_precision("bf16"), mlp)
    obj = json.loads((tmp_path / "p.json").read_text())
    obj["version"] = 1
    del obj["precision"]
    loaded = load_strategy(obj, mlp)
    assert loaded.precision == "model" and loaded == plan


def test_precision_survives_replace_and_microbatches(mlp):
    plan = baseline("data_parallel", mlp, 2).with_precision("bf16")
    op, cfg = plan.configs[1]
    assert plan.replace(op, cfg).precision == "bf16"
    assert plan.with_microbatches(2).precision == "bf16"


@pytest.mark.parametrize("value", ["bfloat16", "fp8", 16])
def test_a_bad_precision_is_one_line(tmp_path, mlp, value):
    plan = baseline("data_parallel", mlp, 2)
    save_strategy(tmp_path / "p.json", plan, mlp)
    obj = json.loads((tmp_path / "p.json").read_text())
    obj["precision"] = value
    with pytest.raises(PlanError) as e:
        load_strategy(obj, mlp)
    msg = str(e.value)
    assert "\n" not in msg and "precision" in msg and repr(value) in msg or str(value) in msg
    if isinstance(value, str):
        assert "['model', 'bf16', 'fp16']" in msg
    with pytest.raises(PlanError, match=r"precision.*must be one of \['model', 'bf16', 'fp16'\]"):
        Strategy(plan.configs, 2, precision="fp8")
    with pytest.raises(ValueError, match=r"search precision = 'fp8'"):
        SearchConfig(proposals=1, precision="fp8")


def test_plan_and_simulate_dtype_flags(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "data_parallel", "--topology",
                 "a100-1x8", "--devices", "2", "--dtype", "bf16", "-o", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"
    assert json.loads(path.read_text())["precision"] == "bf16"
    times = {}
    for flag in (None, "fp32", "bf16"):
        argv = ["simulate", "mlp", "--variant", "tiny", "--plan", str(path), "--topology", "a100-1x8", "--json"]
        assert main(argv + (["--dtype", flag] if flag else [])) == 0
        times[flag] = json.loads(capsys.readouterr().out)["iteration_ms"]
    assert times[None] == times["bf16"] != times["fp32"]  # the plan's bf16 reaches the simulator
    for cmd in (["plan", "mlp", "--baseline", "data_parallel", "-o", str(tmp_path / "q.json")],
                ["simulate", "mlp", "--baseline", "data_parallel"], ["search", "mlp", "--proposals", "1"]):
        try:  # argparse refuses it: one "invalid choice" line (an ArgumentError where the tests make it raise)
            main(cmd + ["--dtype", "bfloat16"])
        except SystemExit as e:
            assert e.code == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]
        except argparse.ArgumentError as e:
            err = str(e)
        assert "--dtype" in err and "invalid choice: 'bfloat16'" in err


def test_search_dtype_reaches_the_found_plan(tmp_path, capsys):
    path = tmp_path / "found.json"
    assert main(["search", "mlp", "--variant", "tiny", "--topology", "a100-1x8", "--devices", "2",
                 "--proposals", "20", "--workers", "1", "--dtype", "bf16", "-o", str(path), "--json"]) == 0
    capsys.readouterr()
    assert json.loads(path.read_text())["precision"] == "bf16"
