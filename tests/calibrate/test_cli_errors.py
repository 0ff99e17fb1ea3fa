"""``soapsearch compare`` and ``calibrate`` report an error as every command does: one line
``soapsearch <command>: error: ...`` on stderr, exit status 2, nothing on stdout (``--json``
output stays parseable). Each case fails before any process is started."""

import importlib
import json

import pytest

from soapsearch.calibrate._spawn import SpawnError
from soapsearch.cli import main
from soapsearch.executor import build_model
from strategies import baseline, save_strategy


def _fails(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith(f"soapsearch {argv[0]}: error: ") and err.count("\n") == 1
    assert message in err, err


def _plan(path, devices):
    graph = build_model("mlp", "tiny").graph
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


@pytest.mark.parametrize("argv", [["compare", "p.json", "--model", "mlp", "--topology", "local-cpu-2"],
                                  ["calibrate", "--nproc", "2", "-o", "t.json"]])
def test_failing_processes_are_reported_the_same_way(argv, capsys, monkeypatch):
    def failed(*args, **kwargs):
        raise SpawnError("calibration processes failed: rank 0: no result")
    module = importlib.import_module("soapsearch.calibrate." + ("compare" if argv[0] == "compare" else "measure"))
    monkeypatch.setattr(module, argv[0], failed)  # (the package's own `compare` is the function)
    _fails(capsys, argv, "calibration processes failed: rank 0: no result")
