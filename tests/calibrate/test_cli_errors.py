"""``soapsearch compare`` and ``calibrate`` report an error as every command does: one line
``soapsearch <command>: error: ...`` on stderr, exit status 2, nothing on stdout (``--json``
output stays parseable). Each case fails before any process is started."""

import importlib
import json

import pytest

from soapsearch.calibrate._spawn import SpawnError
from strategies import baseline, save_strategy
from tests.conftest import cli_error, traced


def _fails(capsys, argv, message):
    assert message in cli_error(capsys, argv)


def _plan(path, devices):
    graph = traced("mlp")
    save_strategy(path, baseline("data_parallel", graph, devices), graph, topology=f"local-cpu-{devices}")
    return str(path)


def test_compare_missing_plan(tmp_path, capsys):
    _fails(capsys, ["compare", str(tmp_path / "nope.json"), "--model", "mlp", "--topology", "local-cpu-2", "--json"],
           "nope.json': cannot read the plan file")


def test_compare_plan_with_more_devices_than_the_topology(tmp_path, capsys):
    _fails(capsys, ["compare", _plan(tmp_path / "dp4.json", 4), "--model", "mlp", "--topology", "local-cpu-2",
                    "--json"],
           "the plan uses 4 devices but topology 'local-cpu-2' has 2")


def test_compare_topology_file_with_an_unknown_key(tmp_path, capsys):
    from simulator.presets import get_topology

    obj = get_topology("local-cpu-2").to_json()
    obj["devices"][0]["contension"] = 2
    (tmp_path / "t.json").write_text(json.dumps(obj))
    _fails(capsys, ["compare", _plan(tmp_path / "dp2.json", 2), "--model", "mlp", "--topology",
                    str(tmp_path / "t.json"), "--json"],
           "devices[0].contension = 2: unknown key (did you mean 'contention'?)")


def test_calibrate_bad_nproc(tmp_path, capsys):
    _fails(capsys, ["calibrate", "--nproc", "0", "-o", str(tmp_path / "t.json")], "nproc = 0: must be >= 1")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("module, argv", [
    ("compare", ["compare", "p.json", "--model", "mlp", "--topology", "local-cpu-2"]),
    ("measure", ["calibrate", "--nproc", "2", "-o", "t.json"])])
def test_failing_processes_are_reported_the_same_way(module, argv, capsys, monkeypatch, tmp_path):
    def failed(*args, **kwargs):
        raise SpawnError("calibration processes failed: rank 0: no result")
    monkeypatch.chdir(tmp_path)  # the relative paths: nothing lands in the repository
    # the module, not the package's function of the same name
    monkeypatch.setattr(importlib.import_module(f"soapsearch.calibrate.{module}"), argv[0], failed)
    _fails(capsys, argv, "calibration processes failed: rank 0: no result")
