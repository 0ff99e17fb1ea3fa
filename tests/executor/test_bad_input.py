"""Bad input to ``soapsearch run`` and to a MODEL argument is one ``soapsearch <command>: error:``
line naming the file, field and value, rc 2, and for ``run`` no torchrun process is started:
the launching process checks the plan the way every rank does before spawning anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import soapsearch.executor.launch as launch_mod
from soapsearch.cli import main
from strategies.baselines import data_parallel
from strategies.serialize import save_strategy
from tests.conftest import cli_error, traced
from tests.soapsearch.test_cli import OPAQUE_NET

ROOT = Path(__file__).resolve().parents[2]
TINY_MLP = ["--model", "mlp", "--variant", "tiny"]


@pytest.fixture
def spawned(monkeypatch):
    """The commands ``launch`` would have started (none is: the spawn is replaced)."""
    calls: list[list[str]] = []
    monkeypatch.setattr(launch_mod.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    return calls


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    """A valid 2-device plan for mlp tiny (batch 4) and broken copies of it."""
    d = tmp_path_factory.mktemp("plans")
    g = traced("mlp")
    save_strategy(d / "dp2.json", data_parallel(g, 2), g)
    obj = json.loads((d / "dp2.json").read_text())
    (d / "no_topology.json").write_text(json.dumps({k: v for k, v in obj.items() if k != "topology"}))
    (d / "array.json").write_text("[1, 2]")
    (d / "not_json.json").write_text("{not json")
    (d / "binary.json").write_bytes(b"\x80\xff{}")
    obj["topology"]["num_devices"] = "2"
    (d / "str_devices.json").write_text(json.dumps(obj))
    return d


@pytest.mark.parametrize("name, expected", [
    ("missing.json", ["'", "missing.json", "cannot read the plan file"]),
    ("no_topology.json", ["no_topology.json: topology = None: this field is missing"]),
    ("array.json", ["array.json: json = 'list': a plan is a JSON object"]),
    ("not_json.json", ["not_json.json: json = 'line 1 column 2': not valid JSON"]),
    ("binary.json", ["binary.json", "not a text file"]),
    ("str_devices.json", ["str_devices.json: num_devices = '2': must be a JSON integer"]),
])
def test_a_broken_plan_file_is_one_line_naming_the_file(plans, capsys, spawned, name, expected):
    err = cli_error(capsys, ["run", str(plans / name), *TINY_MLP])
    assert all(s in err for s in expected), err
    assert spawned == []


def test_a_plan_for_another_model_or_batch_is_refused_before_spawning(plans, capsys, spawned):
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), "--model", "alexnet", "--variant", "tiny"])
    assert "dp2.json: model.fingerprint = " in err and "the model given is alexnet-tiny (batch 4" in err
    assert "another model, variant or batch size: mlp (batch 4)" in err  # what the plan was made for
    assert "first difference: op 0 ('inputs') has dims ['sample', 'd1'] in the plan, ['sample', 'd1', 'd2', 'd3']" in err
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), *TINY_MLP, "--batch-size", "2"])
    assert "model.fingerprint" in err and "the model given is mlp-tiny (batch 2" in err
    assert "first difference: op 0 ('inputs') has shape [4, 16] in the plan, [2, 16] in the model" in err
    assert spawned == []


def test_a_plan_run_with_another_variant_names_the_variants_and_the_first_op_that_differs(
        tmp_path, capsys, spawned):
    plan = tmp_path / "tiny.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "data_parallel", "--devices", "2",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    err = cli_error(capsys, ["run", str(plan), "--model", "mlp", "--variant", "small", "--batch-size", "4"])
    assert "made for another model, variant or batch size: mlp-tiny (batch 4), " in err
    assert "the model given is mlp-small (batch 4, fingerprint " in err
    assert "first difference: op 0 ('inputs') has shape [4, 16] in the plan, [4, 256] in the model" in err
    assert spawned == []


def test_nccl_without_cuda_is_one_line_before_anything_starts(plans, capsys, spawned, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), *TINY_MLP, "--backend", "nccl"])
    assert err.endswith("--backend nccl: NCCL needs CUDA and torch.cuda.is_available() is False on this "
                        "machine; use --backend gloo\n")
    # CUDA with fewer GPUs than the plan's processes (torchrun starts them all on this machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), *TINY_MLP, "--backend", "nccl"])
    assert "--backend nccl: 2 processes need 2 GPUs (one each) and torch.cuda.device_count() = 1" in err
    assert spawned == []


def test_nproc_must_match_the_plan(plans, capsys, spawned):
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), *TINY_MLP, "--nproc", "1"])
    assert "--nproc = 1: the plan" in err and "topology.num_devices = 2" in err
    assert spawned == []


@pytest.mark.parametrize("flag, value, rule", [
    ("--nproc", "0", "--nproc = 0: must be >= 1"),
    ("--steps", "-1", "--steps = -1: must be >= 1"),
    ("--steps", "0", "--steps = 0: must be >= 1"),
    ("--timeout", "-1", "timeout = -1.0: must be a number of seconds > 0"),
    ("--timeout", "nan", "timeout = nan: must be"),
    ("--save", "/", "--save /: is a directory"),
    ("--trace", "/", "--trace /: is a directory"),
    ("--batch-size", "0", "--batch-size = 0: must be >= 1"),
    ("--lr", "-1", "lr = -1.0: the learning rate must be > 0"),
])
def test_a_flag_no_run_can_use_is_refused_up_front(plans, capsys, spawned, flag, value, rule):
    err = cli_error(capsys, ["run", str(plans / "dp2.json"), *TINY_MLP, flag, value])
    assert rule in err, err
    assert spawned == []


def test_run_variant_has_the_zoo_choices(plans, capsys, spawned):
    with pytest.raises(SystemExit) as e:
        main(["run", str(plans / "dp2.json"), "--model", "mlp", "--variant", "bogus"])
    assert e.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err and spawned == []


def test_a_plan_with_an_opaque_op_is_launched(tmp_path, capsys, spawned):
    """An op no rule covers runs whole on one device (``strategies.rules.opaque``; its parity is
    tests/executor/test_parity_opaque.py): ``run`` launches the plan as any other."""
    src = tmp_path / "opaque.py"
    src.write_text(OPAQUE_NET)
    plan = tmp_path / "p.json"
    assert main(["plan", f"{src}:make", "--baseline", "data_parallel", "--devices", "1", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--model", f"{src}:make"]) == 0
    [cmd] = spawned
    assert "--nproc-per-node=1" in cmd


def test_a_good_plan_is_launched_with_one_process_per_device(plans, capsys, spawned):
    assert main(["run", str(plans / "dp2.json"), *TINY_MLP, "--steps", "3"]) == 0
    [cmd] = spawned
    assert "--nproc-per-node=2" in cmd and cmd[cmd.index("-m", 3) + 1] == "soapsearch.run"
    assert cmd[cmd.index("--steps") + 1] == "3" and cmd[cmd.index("--model") + 1] == "mlp"


def test_the_real_command_prints_one_line_and_starts_no_torchrun(plans):
    r = subprocess.run([sys.executable, "-m", "soapsearch", "run", str(plans / "dp2.json"), *TINY_MLP,
                        "--nproc", "3"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("soapsearch run: error: --nproc = 3: the plan") and r.stderr.count("\n") == 1
    assert "torch.distributed" not in r.stderr and "ChildFailedError" not in r.stderr


# --- MODEL arguments: a factory file or module that fails is a ModelLoadError, not a traceback

_FACTORIES = """
import torch

def needs_args(n):
    return torch.nn.Linear(n, n), (torch.randn(2, n),)

def raises():
    return _helper()

def _helper():
    raise RuntimeError("no weights here")
"""


@pytest.mark.parametrize("factory, expected", [
    ("needs_args", ["calling the factory failed: TypeError: needs_args() missing 1 required "
                    "positional argument: 'n'"]),
    ("raises", ["calling the factory failed: RuntimeError: no weights here (at ", "factories.py:11)"]),
])
def test_a_failing_factory_is_one_line(tmp_path, capsys, factory, expected):
    (tmp_path / "factories.py").write_text(_FACTORIES)
    spec = f"{tmp_path / 'factories.py'}:{factory}"
    err = cli_error(capsys, ["show", spec])
    assert f"model {spec!r}: " in err and all(s in err for s in expected), err


def test_a_factory_file_that_does_not_load_is_one_line(tmp_path, capsys):
    (tmp_path / "syntax.py").write_text("import torch\ndef make(:\n    pass\n")
    err = cli_error(capsys, ["show", f"{tmp_path / 'syntax.py'}:make"])
    assert "loading" in err and "failed: SyntaxError: " in err and "(syntax.py, line 2)" in err
    assert "_soapsearch_user_syntax" not in sys.modules
    (tmp_path / "at_import.py").write_text("import torch\nraise KeyError('boom')\n")
    err = cli_error(capsys, ["show", f"{tmp_path / 'at_import.py'}:make"])
    assert "failed: KeyError: 'boom' (at " in err and "at_import.py:2)" in err


@pytest.mark.parametrize("spec", [":", "json:", ":make"])
def test_a_model_spec_with_an_empty_part_is_one_line(capsys, spec):
    err = cli_error(capsys, ["show", spec])
    assert f"model {spec!r}: expected 'path/to/file.py:factory' or 'package.module:factory'" in err
