"""The entry points: ``python -m soapsearch.run`` under torchrun trains, prints losses and saves
a loadable state_dict equal to single-device training; a plan for another world size, or with
an opaque op with no recorded call, fails with a clear message before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from soapsearch.executor import ExecutorError, TrainConfig, build_model, check_runnable
from soapsearch.executor.cli import add_run_parser
from soapsearch.run import to_argv
from strategies.baselines import data_parallel, owt
from strategies.graph import OpGraph, OpNode
from strategies.lowering import lower
from strategies.serialize import save_strategy
from tests.executor.harness import F32_ATOL, F32_RTOL
from tests.executor.reference import reference_train

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def test_world_size_mismatch_is_refused_before_any_work():
    built = build_model("mlp", "tiny")
    with pytest.raises(ExecutorError, match=r"plan is for 2 devices but WORLD_SIZE is 4"):
        check_runnable(lower(built.graph, data_parallel(built.graph, 2)), 4)


def test_opaque_op_without_its_call_is_refused_before_any_work():
    """A graph built by hand whose opaque op has no recorded call (soapsearch.trace records it)."""
    built = build_model("mlp", "tiny")
    nodes = [OpNode(n.name, "opaque" if n.kind == "elementwise" else n.kind, n.inputs, n.output, n.dims,
                    n.weights, {**n.attrs, "target": "my_fn"}, n.input_specs) for n in built.graph]
    graph = OpGraph(nodes, built.graph.outputs)
    with pytest.raises(ExecutorError, match=r"opaque op\(s\).*my_fn"):
        check_runnable(lower(graph, data_parallel(graph, 1)), 1)


def test_run_without_enough_processes_exits_2_with_the_reason(tmp_path):
    built = build_model("mlp", "tiny")
    plan = tmp_path / "plan.json"
    save_strategy(plan, data_parallel(built.graph, 2), built.graph)
    r = subprocess.run([sys.executable, "-m", "soapsearch.run", str(plan), "--model", "mlp",
                        "--variant", "tiny"], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2
    assert "plan is for 2 devices but WORLD_SIZE is 1" in r.stderr
    assert "step" not in r.stdout


def test_cli_run_parser_round_trips_the_flags():
    import argparse
    p = argparse.ArgumentParser()
    add_run_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["run", "plan.json", "--model", "mlp", "--variant", "tiny", "--steps", "3",
                         "--optimizer", "adam", "--nproc", "2"])
    assert args.nproc == 2 and args.fn is not None
    argv = to_argv(args)
    assert argv[:3] == ["plan.json", "--model", "mlp"]
    assert argv[argv.index("--optimizer") + 1] == "adam" and argv[argv.index("--steps") + 1] == "3"


@pytest.mark.distributed
def test_torchrun_entry_point_trains_and_saves(tmp_path):
    built = build_model("mlp", "tiny")
    plan, weights = tmp_path / "plan.json", tmp_path / "w.pt"
    save_strategy(plan, owt(built.graph, 2), built.graph)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "soapsearch.run", str(plan), "--model", "mlp", "--variant", "tiny", "--steps", "2",
           "--save", str(weights), "--timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in r.stdout.splitlines()
              if line.startswith("step ")]
    ref = reference_train(built.model, built.inputs, built.graph, TrainConfig(), steps=2)
    assert losses == pytest.approx(ref["losses"], rel=F32_RTOL)
    fresh = build_model("mlp", "tiny", seed=1).model
    fresh.load_state_dict(torch.load(weights))
    for k, v in ref["states"][-1].items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=F32_RTOL, atol=F32_ATOL)


@pytest.mark.distributed
def test_a_killed_rank_makes_the_others_exit_naming_it_and_the_op(tmp_path):
    import time
    from strategies.baselines import model_parallel
    from tests.executor.gloo import free_port
    built = build_model("mlp", "tiny")
    plan = tmp_path / "plan.json"
    save_strategy(plan, model_parallel(built.graph, 2), built.graph)
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank in (0, 1):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.executor._kill_worker", str(plan), "--model", "mlp",
             "--variant", "tiny", "--steps", "2", "--timeout", "20"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out0, err0 = procs[0].communicate(timeout=90)
    procs[1].communicate(timeout=30)
    assert time.monotonic() - t0 < 60
    assert procs[0].returncode == 1, err0[-2000:]
    assert "rank 1" in err0 and "op '" in err0, err0[-2000:]
