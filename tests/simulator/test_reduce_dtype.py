"""The simulator charges a plan's gradient reduce dtype (``Strategy.reduce_dtype``; docs/design.md,
"Mixed precision"): a bf16 plan reducing in float32 moves its buckets' all-reduces and its
level-2/3 reduce-scatters in 4 bytes an element and nothing else more, a level-3 use holds the
float32 reduce-scatter input beside its gradient, and delta simulation equals full."""

import random

import pytest

from simulator.cost import get_cost_model
from simulator.memory import memory_breakdown
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch.search.api import Evaluator
from soapsearch.search.mcmc import candidate_configs
from strategies import baseline, data_parallel
from strategies.errors import PlanError
from strategies.lowering import lower, lower_reference
from strategies.zero import gather_groups
from tests.conftest import traced


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp", batch_size=16)


def _run(graph, plan):
    return simulate_plan(graph, plan, get_topology("a100-1x8"), get_cost_model("analytical"), optimizer="adam")


def test_data_parallel_all_reduces_twice_the_bucket_bytes(mlp):
    plan = data_parallel(mlp, 8).with_precision("bf16")
    half, wide = _run(mlp, plan), _run(mlp, plan.with_precision("bf16", "float32"))
    buckets = lower(mlp, plan).gradient_sync.buckets
    assert len(buckets) == 1 and all(k.dtype == "bfloat16" for k in buckets)
    moved = sum(buckets.values())  # one all-reduce of the bf16 gradients; the loss sum rides in float32
    assert sum(wide.bytes_moved.values()) - sum(half.bytes_moved.values()) == moved
    assert wide.iteration_time > half.iteration_time
    # the flat bucket, held from its issue to the sync at the peak, is in float32: twice the bf16 one
    assert [w - h for w, h in zip(wide.peak_memory_bytes, half.peak_memory_bytes)] == [moved] * 8


def test_fsdp_reduce_scatters_in_float32_and_gathers_in_bf16(mlp):
    plan = baseline("fsdp", mlp, 8).with_precision("bf16")
    wide_plan = plan.with_precision("bf16", "float32")
    half, wide = _run(mlp, plan), _run(mlp, wide_plan)
    low = lower(mlp, plan)
    groups = gather_groups(low)
    assert groups and all(u.zero == 3 for u in groups)
    # every group's reduce-scatter once per micro-batch, its n chunks in 2 more bytes an element
    scattered = sum(u.chunk_bytes * len(u.devices) for u in groups) * plan.microbatches
    assert sum(wide.bytes_moved.values()) - sum(half.bytes_moved.values()) == scattered
    mh, mw = memory_breakdown(low, "adam"), memory_breakdown(lower(mlp, wide_plan), "adam")
    for a, b in zip(mh, mw):
        assert (a.weights, a.gradients, a.optimizer_state, a.master_weights, a.activations) == \
            (b.weights, b.gradients, b.optimizer_state, b.master_weights, b.activations)
        # the float32 copy of the largest use's gradient: 2 bytes more than the bf16 gradient held
        assert b.gathered_weights - a.gathered_weights == 2 * max(u.nbytes for u in groups)
    assert [w - h for w, h in zip(wide.peak_memory_bytes, half.peak_memory_bytes)] == \
        [b.gathered_weights - a.gathered_weights for a, b in zip(mh, mw)]


def test_delta_equals_full_reducing_in_float32(mlp):
    """40 one-op proposals from a bf16 data-parallel plan reducing in float32, each op's level
    drawn (0-3): the search's Evaluator (delta) equals a full simulation on each valid one."""
    topo = get_topology("a100-1x8")
    n, cost = topo.num_devices, get_cost_model("analytical")
    evaluate = Evaluator(mlp, topo, cost, "adam", "bf16", reduce_dtype="float32")
    candidates = candidate_configs(mlp, n, 1, topo.node_size)
    ops = [op for op in candidates if any(w.trainable for w in mlp[op].weights)]
    rng = random.Random("reduce-float32")
    current = evaluate.planned(data_parallel(mlp, n).with_precision("bf16", "float32"))
    assert current.reduce_dtype == "float32"
    compared = 0
    for _ in range(40):
        op = rng.choice(ops)
        cfg = rng.choice(candidates[op]) if rng.random() < 0.5 else current[op]
        proposal = current.replace(op, cfg.with_memory(zero=rng.choice((0, 1, 3))))
        try:
            lower_reference(mlp, proposal)
        except PlanError:
            continue
        delta = evaluate(proposal, summary=True)
        full = simulate_plan(mlp, proposal, topo, cost, optimizer="adam", summary=True)
        assert (delta.iteration_time, delta.peak_memory_bytes, delta.busy_time, delta.bytes_moved,
                delta.num_tasks) == (full.iteration_time, full.peak_memory_bytes, full.busy_time,
                                     full.bytes_moved, full.num_tasks)
        compared += 1
        if rng.random() < 0.5:
            current = proposal
    assert compared >= 20


def test_the_cli_writes_and_simulates_it(tmp_path, capsys):
    """``plan --reduce-dtype float32`` records it, ``simulate --reduce-dtype`` replaces it (twice
    the bucket bytes moved in float32), and fp32 with float32 is refused in one line."""
    import json

    from soapsearch.cli import main
    from tests.conftest import cli_error

    path = tmp_path / "p.json"
    common = ["mlp", "--variant", "tiny", "--topology", "a100-1x8"]
    assert main(["plan", *common, "--baseline", "data_parallel", "--devices", "2", "--dtype", "bf16",
                 "--reduce-dtype", "float32", "-o", str(path)]) == 0
    assert json.loads(path.read_text())["reduce_dtype"] == "float32"
    capsys.readouterr()
    moved = []
    for extra in ([], ["--reduce-dtype", "compute"]):
        assert main(["simulate", *common, "--plan", str(path), "--json", *extra]) == 0
        moved.append(sum(json.loads(capsys.readouterr().out)["bytes_moved"].values()))
    buckets = sum(lower(traced("mlp"), data_parallel(traced("mlp"), 2).with_precision("bf16"))
                  .gradient_sync.buckets.values())
    assert moved[0] - moved[1] == buckets
    err = cli_error(capsys, ["plan", *common, "--baseline", "data_parallel", "--devices", "2",
                             "--reduce-dtype", "float32", "-o", str(tmp_path / "q.json")])
    assert "reduce_dtype = 'float32': a gradient reduce dtype other than 'compute' needs mixed precision" in err


def test_search_keeps_the_reduce_dtype_the_user_set(tmp_path, capsys):
    """``search --dtype bf16 --reduce-dtype float32`` returns a plan reducing in float32, its
    predicted time the one a full simulation of it gives; with fp32 it is refused in one line."""
    import json

    from soapsearch.cli import main
    from tests.conftest import cli_error

    path = tmp_path / "found.json"
    args = ["search", "mlp", "--variant", "tiny", "--topology", "a100-1x8", "--devices", "2", "--proposals", "20",
            "--workers", "1", "--optimizer", "adam"]
    assert main([*args, "--dtype", "bf16", "--reduce-dtype", "float32", "-o", str(path), "--json"]) == 0
    capsys.readouterr()
    found = json.loads(path.read_text())
    assert (found["precision"], found["reduce_dtype"]) == ("bf16", "float32")
    from strategies import load_strategy
    graph = traced("mlp")
    plan = load_strategy(found, graph)
    full = simulate_plan(graph, plan, get_topology("a100-1x8"), get_cost_model("analytical"), optimizer="adam")
    assert found["predicted"]["iteration_ms"] == pytest.approx(full.iteration_time * 1e3, rel=1e-9)
    err = cli_error(capsys, [*args, "--reduce-dtype", "float32", "-o", str(tmp_path / "x.json")])
    assert "search reduce_dtype = 'float32'" in err and "bf16 or fp16" in err
