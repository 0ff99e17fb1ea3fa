import itertools
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from soapsearch import trace
from soapsearch.cli import main
from soapsearch.search import plan_cost, search
from soapsearch.search.mcmc import candidate_configs
from strategies import Strategy, baseline, load_strategy
from tests.conftest import traced


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 512)

    def forward(self, x, t):
        return F.cross_entropy(self.fc(x), t)


@pytest.fixture(scope="module")
def small():
    with torch.device("meta"):
        model = Small()
    x = torch.empty(64, 256, device="meta")
    t = torch.empty(64, dtype=torch.long, device="meta")
    return trace(model, (x, t))


def test_finds_the_exhaustive_optimum_on_a_tiny_graph(small):
    topo = get_topology("p100-1x2")
    cands = candidate_configs(small, 2, 1, None)
    sizes = [len(c) for c in cands.values()]
    plans = [Strategy.of(dict(zip(cands, combo)), 2) for combo in itertools.product(*cands.values())]
    assert len(plans) == sizes[0] * sizes[1] * sizes[2] * sizes[3] > 50
    best = min(plan_cost(simulate_plan(small, p, topo)) for p in plans)
    found = search(small, topology=topo, budget_s=None, proposals=3000, seed=1)
    assert found.predicted_ms == pytest.approx(best, rel=1e-12)


def test_same_seed_same_plan_and_never_worse_than_the_start(tmp_path):
    g = traced("alexnet", "default")
    runs = [search(g, topology="p100-1x4", budget_s=None, proposals=300, seed=7,
                   init=("data_parallel", "owt")) for _ in range(2)]
    assert runs[0].strategy == runs[1].strategy and runs[0].predicted_ms == runs[1].predicted_ms
    best_so_far = [h[2] for h in runs[0].history]
    assert best_so_far == sorted(best_so_far, reverse=True) and len(best_so_far) >= 2
    best_init = min(runs[0].baselines["data_parallel"], runs[0].baselines["owt"])
    assert runs[0].predicted_ms <= best_init
    other = search(g, topology="p100-1x4", budget_s=None, proposals=300, seed=8,
                   init=("data_parallel", "owt"))
    assert other.predicted_ms <= best_init
    path = tmp_path / "plan.json"
    runs[0].save(path)
    again = simulate_plan(g, load_strategy(path, g), get_topology("p100-1x4"))
    assert again.iteration_ms == runs[0].predicted_ms
    pred = json.loads(path.read_text())["predicted"]
    assert pred["iteration_ms"] == runs[0].predicted_ms and set(pred["baselines"]) >= {"data_parallel", "owt"}


def test_search_beats_data_parallel_where_tensor_parallel_wins():
    g = traced("mlp", "default")  # 1.8 GiB of fully-connected weights: all-reduce dominates DP
    r = search(g, topology="p100-1x4", budget_s=None, proposals=400, seed=0)
    assert r.predicted_ms < 0.5 * r.baselines["data_parallel"]
    assert r.result.fits


def test_init_from_a_plan_file_and_bad_init(tmp_path):
    g = traced("mlp")
    from strategies import save_strategy
    path = tmp_path / "start.json"
    save_strategy(path, baseline("model_parallel", g, 2), g)
    r = search(g, topology="p100-1x2", budget_s=None, proposals=50, init=(str(path),))
    assert r.predicted_ms <= r.baselines["model_parallel"]
    with pytest.raises(ValueError, match="init = 'nope'"):
        search(g, topology="p100-1x2", budget_s=None, proposals=5, init=("nope",))


def test_default_start_where_the_batch_does_not_divide_by_the_devices(tmp_path, capsys):
    """Batch 2 on 4 devices: no data parallel (nor OWT) plan; the chains start from ``hybrid``
    (data parallel 2 ways x tensor parallel 2 ways), which the closing table lists; data
    parallel asked for by name is still refused with its reason."""
    g = traced("gpt", batch_size=2)
    r = search(g, topology="p100-1x4", budget_s=None, proposals=100, seed=0)
    assert "data_parallel" not in r.baselines and "owt" not in r.baselines
    hybrid_ms = simulate_plan(g, baseline("hybrid", g, 4), get_topology("p100-1x4")).iteration_ms
    assert r.baselines["hybrid"] == hybrid_ms and r.predicted_ms <= min(r.baselines.values())
    with pytest.raises(ValueError, match=r"^init 'data_parallel': num_devices = 4: batch 2 is not divisible by 4 devices"):
        search(g, topology="p100-1x4", budget_s=None, proposals=5, init=("data_parallel",))
    assert "hybrid" not in search(traced("gpt"), topology="p100-1x4", budget_s=None, proposals=5).baselines
    six = traced("gpt", batch_size=6)  # 2 micro-batches of 3 on 4 devices: hybrid per micro-batch
    r = search(six, topology="p100-1x4", budget_s=None, proposals=20, microbatches=2)  # hybrid per micro-batch
    r.strategy.validate(six)
    assert r.predicted_ms <= min(r.baselines.values())
    out = tmp_path / "plan.json"
    assert main(["search", "gpt", "--variant", "tiny", "--batch-size", "2", "--topology", "p100-1x4",
                 "--budget", "0", "--proposals", "50", "-o", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "\nhybrid " in shown and "data_parallel" not in shown and "vs hybrid" in shown
    assert load_strategy(out, g).num_devices == 4


def test_cli_search_json_and_show_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--budget", "30",
                 "--proposals", "200", "--init", "data_parallel,owt", "-o", str(out), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["plan"] == str(out) and obj["iteration_ms"] <= min(obj["baselines"].values())
    plan = load_strategy(out, traced("mlp"))
    assert plan.num_devices == 2
    assert main(["show-plan", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "layers_0" in shown and "@" in shown and "predicted" in shown


@pytest.mark.parametrize("optimizer,moments", [("sgd", 1), ("adam", 2)])
def test_cli_search_optimizer_reaches_the_evaluator(tmp_path, capsys, optimizer, moments):
    """``search --optimizer adam`` scores plans with Adam's two moments per trainable byte: the
    found plan's peak is the one simulate gives it with that optimizer, and its breakdown holds
    as many optimizer-state bytes as gradients times the moments. The closing table's last
    line names the peak and its largest categories."""
    out = tmp_path / "plan.json"
    args = ["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--budget", "0",
            "--proposals", "20", "--workers", "1", "--optimizer", optimizer, "-o", str(out)]
    assert main(args + ["--json"]) == 0
    peak = json.loads(capsys.readouterr().out)["peak_memory"]
    grads = peak["breakdown"]["gradients"]
    assert grads > 0 and peak["breakdown"]["optimizer_state"] == moments * grads
    g = traced("mlp")
    again = simulate_plan(g, load_strategy(out, g), get_topology("p100-1x2"), optimizer=optimizer)
    assert peak["bytes"] == max(again.peak_memory_bytes) and peak["breakdown"] == again.peak_breakdown.to_json()
    assert main(args + ["--force"]) == 0
    shown = capsys.readouterr().out
    assert f"found plan's memory, device {peak['device']}: peak " in shown and "optimizer state" in shown


def test_cli_optuna_study_resumes_from_its_storage(tmp_path, capsys):
    store = tmp_path / "study.log"
    args = ["search", "mlp", "--variant", "tiny", "--topology", "p100-1x2", "--budget", "60",
            "--proposals", "40", "--study", str(store), "--json"]
    first, second = [], []
    for out, trials in ((first, "5"), (second, "9")):
        assert main(args + ["--trials", trials, "-o", str(tmp_path / f"p{trials}.json")]) == 0
        out.append(json.loads(capsys.readouterr().out))
    assert store.exists()
    assert second[0]["iteration_ms"] <= first[0]["iteration_ms"] <= min(first[0]["baselines"].values())


def test_when_only_sharding_fits_the_search_finds_a_fitting_plan():
    # gpt tiny on 2 devices (each op keeps what its backward reads as torch saves it,
    # strategies.saved; a weight op none): data parallel peaks at 140,296 B, with 2 micro-batches under 1F1B (one
    # micro-batch's activations held at a time) at 133,248 B (its gradient bucket's flat tensor,
    # 33,280 B, held from the embedding's backward to the sync beside the inputs, 128 B:
    # strategies.collective_buffers.bucket_buffers), fsdp (ZeRO-3: weights, gradients
    # and state halved) at 103,240 B with units of one op and at 125,320 B with the baseline's
    # units of one layer (a layer's and the next layer's call buffers held); 108,000 B a device
    # fits fsdp with units of one op; of the search's baselines megatron (105,024 B: its
    # collectives' buffers as the executor holds them, strategies.collective_buffers) and
    # megatron_lm (one sequence a micro-batch, layers recomputed with their reductions called
    # again, ZeRO-1: 59,136 B) fit, none of
    # the others (model parallel and the pipeline peak at 109,632 B) nor
    # accumulation: the search returns a fitting plan
    import dataclasses

    from simulator.cost import get_cost_model
    from simulator.topology import Topology
    from soapsearch.executor import build_model
    from soapsearch.search.api import Evaluator

    g = build_model("gpt", "tiny").graph
    base = get_topology("local-cpu-2")
    topo = Topology("small-memory", tuple(dataclasses.replace(d, memory_bytes=108_000) for d in base.devices),
                    base.links, base.routes)
    r = search(g, topology=topo, budget_s=None, proposals=2, seed=0)
    assert {k for k, res in r.baseline_results.items() if res.fits} == {"megatron", "megatron_lm"}
    assert max(r.baseline_results["megatron"].peak_memory_bytes) == 105_024
    assert max(r.baseline_results["megatron_lm"].peak_memory_bytes) == 59_136
    assert max(r.baseline_results["fsdp"].peak_memory_bytes) == 125_320
    assert r.result.fits
    evaluate = Evaluator(g, topo, get_cost_model("analytical"))
    per_op = evaluate(baseline("fsdp", g, 2).with_fsdp_unit("op"))
    assert per_op.fits and max(per_op.peak_memory_bytes) == 103_240
    accumulation = evaluate(baseline("data_parallel", g, 2).with_microbatches(2, "1f1b"))
    assert not accumulation.fits and max(accumulation.peak_memory_bytes) == 133_248


def test_chains_side_by_side_find_what_they_find_in_turn():
    g = traced("alexnet", "default")
    kw = dict(topology="p100-1x4", budget_s=None, proposals=400, seed=3, init=("data_parallel", "owt"), chains=4)
    in_turn, side = (search(g, workers=w, **kw) for w in (1, 2))
    assert (in_turn.workers, side.workers) == (1, 2)
    assert side.strategy == in_turn.strategy and side.predicted_ms == in_turn.predicted_ms
    assert (side.proposals, side.accepted) == (in_turn.proposals, in_turn.accepted) and side.proposals >= 4 * 50
    assert side.predicted_ms <= min(side.baselines.values())
    best = [h[2] for h in side.history]
    assert best == sorted(best, reverse=True) and best[-1] == side.predicted_ms


def test_ctrl_c_stops_every_chain_and_keeps_their_best():
    from soapsearch.search.api import Evaluator
    from soapsearch.search.chains import Chain, run_chains
    from soapsearch.search.mcmc import Budget, ChainStats, consider, plan_cost
    from simulator.cost import get_cost_model
    import time
    g = traced("alexnet", "default")
    topo = get_topology("p100-1x4")
    evaluate = Evaluator(g, topo, get_cost_model("analytical"))
    base = ChainStats()
    dp = baseline("data_parallel", g, 4)
    consider(base, dp, evaluate(dp), plan_cost(evaluate(dp)), time.perf_counter())
    chains = [Chain(dp, 0, Budget(seconds=60)) for _ in range(2)]
    seen = []

    def interrupt(progress):  # as one Ctrl-C in the parent once the chains have made proposals
        seen.append(progress)
        if progress.proposals > 20 and not any(p.proposals > 20 for p in seen[:-1]):
            raise KeyboardInterrupt  # once: a second Ctrl-C terminates the workers, results and all

    for workers in (1, 2):
        t0 = time.perf_counter()
        stats, interrupted = run_chains(chains, evaluate, candidate_configs(g, 4, 1, None), base, t0,
                                        beta=None, reset_every=500, workers=workers, on_step=interrupt)
        assert interrupted and time.perf_counter() - t0 < 30
        assert stats.proposals > 20  # stopped well inside 60 s: above
        # the chains' best (alexnet's data parallel on 4 devices is far from the best plan) is kept
        assert stats.best_result.iteration_ms <= seen[-1].best_ms < base.best_result.iteration_ms
        seen.clear()


def test_workers_refused_with_a_cost_model_that_times_kernels(small):
    from simulator.profiled import ProfiledCostModel
    with pytest.raises(ValueError, match="times kernels"):
        search(small, topology="p100-1x2", budget_s=None, proposals=10, chains=2, workers=2,
               cost_model=ProfiledCostModel(cache_path=None))


def test_merge_keeps_consider_s_rule_in_the_history():
    from soapsearch.search.chains import merge
    from soapsearch.search.mcmc import ChainStats, consider
    from simulator.result import SimResult

    def res(ms, fits):
        return SimResult(ms / 1e3, (), (2.0 if not fits else 0.5,), (1.0,), {}, 1)

    base = ChainStats()
    consider(base, "baseline", res(10.0, False), 10.0 * 11, 0.0)  # does not fit: penalized cost
    a, b = ChainStats(), ChainStats()
    for st in (a, b):
        st.history, st.ranks, st.best, st.best_cost, st.best_result = (
            list(base.history), list(base.ranks), base.best, base.best_cost, base.best_result)
    consider(a, "fits, slower", res(15.0, True), 15.0, 2.0)  # fits: better although more ms
    consider(b, "fits, faster", res(12.0, True), 12.0, 1.0)  # (found 1 s later)
    out = merge(base, [a, b])
    assert out.best == "fits, faster" and [h[2] for h in out.history] == [10.0, 15.0, 12.0]
    assert out.history[-1][2] == out.best_result.iteration_ms


def test_a_chain_s_error_is_the_same_with_workers_and_leaves_no_process():
    import multiprocessing
    from soapsearch.search.api import Evaluator
    from soapsearch.search.chains import Chain, run_chains
    from soapsearch.search.mcmc import Budget, ChainStats
    from simulator.cost import get_cost_model
    g = traced("mlp")
    evaluate = Evaluator(g, get_topology("p100-1x2"), get_cost_model("analytical"))
    calls = []

    def failing(plan, summary=False):
        calls.append(plan)
        if len(calls) > 3:
            raise ValueError("op 'fc': a rule broke")
        return evaluate(plan, summary)

    dp = baseline("data_parallel", g, 2)
    chains = [Chain(dp, 0, Budget(proposals=50)) for _ in range(2)]
    for workers in (1, 2):
        calls.clear()  # the error part-way through a chain each time (a forked worker inherits the calls)
        with pytest.raises(ValueError, match="a rule broke"):
            run_chains(chains, failing, candidate_configs(g, 2, 1, None), ChainStats(), 0.0, beta=None,
                       reset_every=500, workers=workers)

    def broken_bar(progress):
        raise RuntimeError("the progress bar broke")

    with pytest.raises(RuntimeError, match="bar broke"):
        run_chains([Chain(dp, 0, Budget(seconds=30)) for _ in range(2)], evaluate, candidate_configs(g, 2, 1, None),
                   ChainStats(), 0.0, beta=None, reset_every=500, workers=2, on_step=broken_bar)
    assert multiprocessing.active_children() == []


def test_budget_split_numpy_counts_and_a_pipeline_start():
    import numpy as np
    g = traced("mlp")
    r = search(g, topology="p100-1x2", budget_s=None, proposals=np.int64(3), chains=np.int64(4), workers=1)
    assert r.proposals == 3  # 1 + 1 + 1: a fourth chain would have had none
    g3 = traced("mlp", batch_size=3)  # a pipeline only over the search's own 3 micro-batches
    r = search(g3, topology="p100-1x2", budget_s=None, proposals=20, microbatches=3, init=("pipeline",))
    assert "pipeline" not in r.baselines and r.result.fits


def test_a_pipeline_start_runs_the_chains_micro_batches_and_plan_errors_cross_processes():
    import pickle
    from strategies.errors import PlanError
    e = pickle.loads(pickle.dumps(PlanError("fc", "degrees", [2, 3], "3 does not divide 4", "init 'x'")))
    assert str(e) == "init 'x': op 'fc': degrees = [2, 3]: 3 does not divide 4" and e.op == "fc"
    from soapsearch import zoo
    g = trace(*zoo.build("gpt", "tiny"))  # the scored pipeline baseline runs 2 micro-batches; the chains 1
    r = search(g, topology="p100-1x4", budget_s=None, proposals=200, chains=2, workers=2, seed=0,
               init=("data_parallel", "pipeline"))
    assert r.strategy.microbatches == 1 and r.result.iteration_time * 1e3 <= min(r.baselines.values())
