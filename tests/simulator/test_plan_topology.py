"""A plan's ``topology`` object names the machine it was made for: a ``num_devices`` beyond
that machine's devices is refused in one line (``check_plan_topology``), by ``show-plan`` and
``run`` alike, before anything is printed or started."""

from __future__ import annotations

import json

import pytest

from simulator.presets import check_plan_topology, get_topology
from strategies import data_parallel
from strategies.errors import PlanError
from strategies.serialize import save_strategy
from tests.conftest import cli_error, traced

RULE = ("topology.num_devices = 8: topology 'local-cpu-2' has 2 devices and a plan uses at most its "
        "topology's devices (8 > 2)")


def test_more_devices_than_the_named_topology_is_refused(tmp_path):
    with pytest.raises(PlanError) as e:
        check_plan_topology({"name": "local-cpu-2", "num_devices": 8}, "p.json")
    assert str(e.value) == f"p.json: {RULE}"
    path = tmp_path / "t.json"
    get_topology("p100-1x2").save(path)
    with pytest.raises(PlanError, match=r"topology.num_devices = 3: topology '.*t.json' has 2 devices .*\(3 > 2\)"):
        check_plan_topology({"name": str(path), "num_devices": 3})


@pytest.mark.parametrize("topology", [
    {"name": "local-cpu-2", "num_devices": 2},
    {"name": "p100-4x4", "num_devices": 2},  # a search on the first devices of a bigger machine
    {"name": "local", "num_devices": 8},  # named nothing this machine knows: not checked
    {"name": "p100-9x9", "num_devices": 8},  # only looks like a preset
    {"num_devices": 8},
])
def test_a_plan_within_its_topology_or_of_an_unknown_one_passes(topology):
    check_plan_topology(topology)


@pytest.fixture
def eight_on_two(tmp_path):
    graph = traced("mlp")
    path = tmp_path / "p8.json"
    save_strategy(path, data_parallel(graph, 2), graph, topology="local-cpu-2")
    obj = json.loads(path.read_text())
    obj["topology"]["num_devices"] = 8
    path.write_text(json.dumps(obj))
    return str(path)


@pytest.mark.parametrize("argv", [["show-plan"], ["run", "--model", "mlp", "--variant", "tiny", "--steps", "1"]])
def test_show_plan_and_run_refuse_it(capsys, eight_on_two, argv):
    err = cli_error(capsys, argv[:1] + [eight_on_two] + argv[1:])
    assert err.endswith(f"{eight_on_two}: {RULE}\n")
