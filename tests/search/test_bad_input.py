"""Bad input to the search, its CLI and show-plan: one clear error naming the field, the value
and the rule, raised before any work, never a traceback or a silently ignored value."""

import json
import math
import sys
from pathlib import Path

import pytest

from soapsearch import simulate
from soapsearch.cli import main
from soapsearch.search import Budget, search, study_search
from strategies import PlanError, baseline, load_strategy, save_strategy
from tests.conftest import cli_error, traced


@pytest.mark.parametrize("seconds, proposals, message", [
    (math.nan, None, r"budget seconds = nan: must be a finite number > 0"),
    (math.inf, None, r"budget seconds = inf"),
    (0, None, r"budget seconds = 0"),
    (None, 0, r"budget proposals = 0: must be a whole number >= 1"),
    (None, 2.5, r"budget proposals = 2.5"),
    (None, None, r"needs seconds or proposals"),
])
def test_budget_rules(seconds, proposals, message):
    with pytest.raises(ValueError, match=message):
        Budget(seconds, proposals)


@pytest.mark.parametrize("kw, message", [
    (dict(proposals=0), r"budget proposals = 0"),
    (dict(budget_s=math.nan), r"budget seconds = nan"),
    (dict(num_devices=0), r"search num_devices = 0: must be a whole number >= 1"),
    (dict(num_devices=3), r"search num_devices = 3: more than the 2 devices of 'p100-1x2'"),
    (dict(microbatches=0), r"search microbatches = 0"),
    (dict(reset_every=-1), r"search reset_every = -1"),
    (dict(beta=-1.0), r"search beta = -1.0: must be a finite number > 0"),
    (dict(beta=math.nan), r"search beta = nan"),
    (dict(schedule="zigzag"), r"search schedule = 'zigzag'"),
    (dict(chains=0), r"search chains = 0"),
    (dict(workers=0), r"search workers = 0"),
    (dict(replicas=0), r"^search replicas = 0: must be a whole number >= 1$"),
    (dict(exhaustive_limit=-1), r"^search exhaustive_limit = -1: must be a whole number >= 0$"),
    (dict(exhaustive_limit=1.5), r"^search exhaustive_limit = 1.5: must be a whole number >= 0$"),
])
def test_search_arguments_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        search(traced("mlp"), topology="p100-1x2", **{"budget_s": None, "proposals": 10, **kw})


def test_init_that_does_not_match_the_search(tmp_path):
    g = traced("mlp")  # batch 4
    two = tmp_path / "dp2.json"
    save_strategy(two, baseline("data_parallel", g, 2), g)
    with pytest.raises(PlanError, match=r"dp2.json: num_devices = 2: the search uses 4 devices"):
        search(g, topology="local-cpu-4", budget_s=None, proposals=10, init=(str(two),))
    # a plan carries its micro-batches (its chain runs them), but each op must take its count
    four = baseline("data_parallel", g, 2).with_microbatches(4)
    with pytest.raises(PlanError, match=r"init: op 'inputs': degrees = \[2, 1\]: degree 2 on dim "
                       r"'sample'\(4 / 4 micro-batches = 1\) does not divide it"):
        search(g, topology="p100-1x2", budget_s=None, proposals=10, init=(four,))
    assert search(g, topology="p100-1x2", budget_s=None, proposals=10, init=(str(two),), microbatches=2,
                  microbatch_move=0).strategy.microbatches == 1
    # a baseline this graph cannot take: its own reason, not "must be a baseline name"
    with pytest.raises(PlanError, match=r"num_devices = 3: batch 4 is not divisible by 3 devices"):
        search(g, topology="local-cpu-4", budget_s=None, proposals=10, num_devices=3, init=("owt",))
    r = search(g, topology="p100-1x2", budget_s=None, proposals=20, init="owt")  # one init, not 'o', 'w', 't'
    assert r.strategy == search(g, topology="p100-1x2", budget_s=None, proposals=20, init=("owt",)).strategy


def test_baselines_name_the_count_at_fault():
    g = traced("mlp")  # batch 4
    with pytest.raises(PlanError, match=r"microbatches = 0: must be a whole number >= 1"):
        baseline("pipeline", g, 2, 0)
    with pytest.raises(PlanError, match=r"microbatches = 3: batch 4 is not divisible by 1 devices x 3"):
        baseline("pipeline", g, 2, 3)
    with pytest.raises(PlanError, match=r"num_devices = 0: must be a whole number >= 1"):
        baseline("model_parallel", g, 0)


def test_api_takes_a_topology_path_and_refuses_a_non_path_plan(tmp_path):
    from simulator.presets import get_topology
    g = traced("mlp")
    path = tmp_path / "topo.json"
    get_topology("local-cpu-2").save(path)
    assert (simulate(g, "data_parallel", topology=Path(path)).iteration_ms
            == simulate(g, "data_parallel", topology="local-cpu-2").iteration_ms)
    with pytest.raises(ValueError, match=r"topology = 4: must be a preset name"):
        simulate(g, "data_parallel", topology=4)
    with pytest.raises(PlanError, match=r"path = None: a plan is a file path or its parsed JSON object"):
        load_strategy(None, g)


def test_study_arguments_are_checked():
    with pytest.raises(ValueError, match=r"study_search trials = 0"):
        study_search(traced("mlp"), topology="p100-1x2", trials=0)


def test_cli_output_checked_before_searching(tmp_path, capsys):
    args = ["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--proposals", "20"]
    assert "is a directory" in cli_error(capsys, args + ["-o", str(tmp_path)])  # one line: no progress bar either
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert f"{blocker} is a file, not a directory" in cli_error(capsys, args + ["-o", str(blocker / "plan.json")])
    assert "budget proposals = 0" in cli_error(capsys, args + ["--proposals", "0", "-o", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()


def _plan_json(tmp_path):
    g = traced("mlp")
    path = tmp_path / "plan.json"
    save_strategy(path, baseline("data_parallel", g, 2), g)
    return json.loads(path.read_text())


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o["ops"][2].pop("degrees"), r"op 'layers_0': degrees = None: this field is missing"),
    (lambda o: o["ops"][2].update(degrees=["a", 1]), r"degrees\[0\] = 'a'"),
    (lambda o: o["ops"][2].update(devices=5), r"op 'layers_0': devices = 5: must be a JSON array"),
    (lambda o: o["ops"][2].update(devices=[0, 99]), r"op 'layers_0': devices = \[0, 99\]: device 99 is out of range"),
    (lambda o: o.update(model="mlp"), r"model = 'mlp': must be a JSON object"),
    (lambda o: o.update(ops=[]), r"ops = \[\]: a plan has a config for every op"),
    (lambda o: o["ops"].__setitem__(0, []), r"ops\[0\] = \[\]: each op is a JSON object"),
    (lambda o: o["ops"][0].update(name=None), r"name = None: must be a JSON string"),
    (lambda o: o.update(version=7), r"version = 7: this soapsearch reads versions 1, 2, 3, 4, 5, 6"),
    (lambda o: o.update(format="other"), r"format = 'other'"),
])
def test_show_plan_checks_the_file(tmp_path, capsys, mutate, message):
    import re
    obj = _plan_json(tmp_path)
    mutate(obj)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    err = cli_error(capsys, ["show-plan", str(path)])
    assert re.search(message, err), err


def test_show_plan_prints_a_plan_with_odd_predictions(tmp_path, capsys):
    obj = _plan_json(tmp_path)
    obj["predicted"] = {"iteration_ms": "fast"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(obj))
    assert main(["show-plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "layers_0" in out and "sample=2 @ 0-1" in out and "predicted" not in out


def test_every_output_flag_is_checked_before_the_work(tmp_path, capsys):
    tiny = ["mlp", "--variant", "tiny"]
    for args, message in ((["plan", *tiny, "--baseline", "data_parallel", "--devices", "2", "-o", str(tmp_path)],
                           f"-o {tmp_path}: is a directory"),
                          (["simulate", *tiny, "--baseline", "data_parallel", "--topology", "local-cpu-2",
                            "--trace", str(tmp_path)], f"--trace {tmp_path}: is a directory")):
        assert message in cli_error(capsys, args)


def test_show_plan_png_path_checked_before_the_plan_is_printed(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_json(tmp_path)))
    assert f"--png {tmp_path}: is a directory" in cli_error(capsys, ["show-plan", str(path), "--png", str(tmp_path)])
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert f"--png {blocker / 'x.png'}: {blocker} is a file, not a directory" in cli_error(
        capsys, ["show-plan", str(path), "--png", str(blocker / "x.png")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    assert "--png needs matplotlib" in cli_error(capsys, ["show-plan", str(path), "--png", str(tmp_path / "x.png")])


NET = """
import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, {width})
    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)

def make(batch_size=4):
    return Net(), (torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)))
"""


def _search(capsys, model: str, out, *flags: str) -> str:
    """``soapsearch search`` of a tiny zoo model writing ``out``; its stdout."""
    assert main(["search", model, "--variant", "tiny", "--topology", "p100-1x2", "--budget", "0",
                 "--proposals", "10", "--workers", "1", *(["-o", str(out)] if out else []), *flags]) == 0
    return capsys.readouterr().out


def test_search_names_the_file_it_wrote_and_keeps_another_model_s_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shown = _search(capsys, "mlp", None)  # no -o: ./plan.json, named in full
    out = tmp_path / "plan.json"
    assert shown.splitlines()[-1] == f"wrote the plan for mlp-tiny to {out}"
    assert _search(capsys, "mlp", out).splitlines()[-1] == (
        f"wrote the plan for mlp-tiny to {out} (replacing its plan for the same model)")
    before = out.read_text()
    err = cli_error(capsys, ["search", "gpt", "--variant", "tiny", "--topology", "p100-1x2", "--proposals", "10"])
    assert err == (f"soapsearch search: error: -o plan.json: holds a plan made for mlp-tiny (batch 4), not "
                   "gpt-tiny (batch 4); give another -o or --force to overwrite it\n")
    assert out.read_text() == before
    assert _search(capsys, "gpt", out, "--force").splitlines()[-1].endswith("(replacing it: --force)")
    assert load_strategy(out, traced("gpt")).num_devices == 2
    # the same name and batch, another model: the fingerprints tell them apart
    src = tmp_path / "net.py"
    for width in (3, 5):
        src.write_text(NET.format(width=width))
        argv = ["plan", f"{src}:make", "--baseline", "data_parallel", "--devices", "2", "-o", "net.json"]
        if width == 3:
            assert main(argv) == 0
            capsys.readouterr()
    made_for = json.loads((tmp_path / "net.json").read_text())["model"]["fingerprint"]
    err = cli_error(capsys, argv)
    assert f"holds a plan made for make (batch 4, fingerprint {made_for!r}), not make (batch 4, fingerprint '" in err
    notes = tmp_path / "notes.json"
    notes.write_text("{}")
    assert (f"-o {notes}: the file exists and is not a plan; give another -o or --force"
            in cli_error(capsys, ["search", "mlp", "--variant", "tiny", "--proposals", "5", "-o", str(notes)]))
    assert notes.read_text() == "{}"
