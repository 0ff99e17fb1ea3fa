import json

import pytest

from soapsearch import SearchConfig
from soapsearch.search.study import INITS, open_storage, study_search
from strategies import load_strategy
from tests.conftest import traced

TOPO = "p100-1x4"
BASELINE_ORDER = ["data_parallel", "model_parallel", "owt", "zero1", "fsdp", "single_device", "megatron", "pipeline"]
"""The mlp's Linear → ReLU → Linear blocks make megatron one of its baselines; zero1 and fsdp are
data parallel with its state sharded."""


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp", "default")


@pytest.fixture(scope="module")
def study(mlp):
    return study_search(mlp, topology=TOPO, trials=10, trial_proposals=40, seed=3)


def test_baselines_are_the_first_trials_and_the_study_beats_them(study):
    first = study.trials[:len(BASELINE_ORDER)]
    assert [t.baseline for t in first] == BASELINE_ORDER
    assert [t.params["init"] for t in first] == BASELINE_ORDER
    assert all(t.params["num_devices"] == 4 and t.params["beta_scale"] == 1.0 for t in first)
    for t in first:  # each chain starts from its expert plan, so it is never worse than it
        assert t.iteration_ms <= study.baselines[t.baseline] * (1 + 1e-12)
    assert all(t.baseline is None for t in study.trials[len(BASELINE_ORDER):])
    assert len(study.trials) == 10 and study.proposals > 100
    assert study.result.fits
    assert study.predicted_ms <= min(study.baselines.values())
    assert study.predicted_ms == min(t.value for t in study.trials if t.value is not None)
    assert study.strategy.num_devices in (1, 2, 4)
    # TPE explores the global knobs, not just the start
    later = study.trials[len(BASELINE_ORDER):]
    assert len({t.params["init"] for t in later}) >= 2
    assert all(t.params["init"] in (*INITS, "megatron") for t in later)
    assert len({t.params["beta_scale"] for t in later}) == len(later)


def test_same_seed_same_study(mlp, study):
    """The same study from a SearchConfig: its proposals are each trial's."""
    again = study_search(mlp, topology=TOPO, config=SearchConfig(budget_s=None, proposals=40, seed=3), trials=10)
    assert [t.params for t in again.trials] == [t.params for t in study.trials]
    assert [t.value for t in again.trials] == [t.value for t in study.trials]
    assert again.strategy == study.strategy and again.predicted_ms == study.predicted_ms


def test_resumes_from_sqlite_and_never_gets_worse(mlp, tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    one = study_search(mlp, topology=TOPO, trials=8, trial_proposals=30, seed=0, storage=url,
                       study_name="mlp")
    two = study_search(mlp, topology=TOPO, trials=4, trial_proposals=30, seed=0, storage=url,
                       study_name="mlp")
    assert len(one.trials) == 8 and len(two.trials) == 12
    assert [t.params for t in two.trials[:8]] == [t.params for t in one.trials]
    assert [t.baseline for t in two.trials[:len(BASELINE_ORDER)]] == BASELINE_ORDER  # not enqueued twice
    assert all(t.baseline is None for t in two.trials[len(BASELINE_ORDER):])
    assert two.predicted_ms <= one.predicted_ms
    if two.predicted_ms == one.predicted_ms:  # the best plan came back from the storage
        assert two.strategy == one.strategy
    with pytest.raises(ValueError, match="fingerprint"):
        study_search(traced("alexnet", "tiny"), topology=TOPO, trials=1, trial_proposals=5,
                     storage=url, study_name="mlp")


def test_journal_storage_and_save(mlp, tmp_path):
    path = tmp_path / "study.jsonl"
    found = study_search(mlp, topology=TOPO, trials=7, trial_proposals=20, storage=str(path),
                         study_name="j")
    assert path.exists() and path.stat().st_size > 0
    again = study_search(mlp, topology=TOPO, trials=1, trial_proposals=20, storage=str(path),
                         study_name="j")
    assert len(again.trials) == 8
    out = tmp_path / "plan.json"
    found.save(out)
    data = json.loads(out.read_text())
    assert data["predicted"]["iteration_ms"] == found.predicted_ms
    assert data["predicted"]["baselines"] == found.baselines
    assert load_strategy(out, mlp) == found.strategy


def test_a_study_made_with_other_initial_plans_resumes(mlp, tmp_path, monkeypatch):
    """optuna refuses a categorical whose choices changed: a study made with other initial plans
    (here without 'hybrid') keeps drawing from the choices it was made with."""
    from soapsearch.search import study as module

    path = str(tmp_path / "old.jsonl")
    old = tuple(i for i in INITS if i != "hybrid")
    monkeypatch.setattr(module, "INITS", old)
    study_search(mlp, topology=TOPO, trials=7, trial_proposals=5, storage=path, study_name="s")
    monkeypatch.undo()
    again = study_search(mlp, topology=TOPO, trials=1, trial_proposals=5, storage=path, study_name="s")
    assert len(again.trials) == 8
    assert all(t.distributions["init"].choices == (*old, "megatron") for t in again.study.trials)


@pytest.mark.parametrize("bad", ["study.db", "nowhere.txt", 42])
def test_bad_storage_is_named(bad):
    with pytest.raises(ValueError, match="storage"):
        open_storage(bad)


def test_unopenable_sqlite_url_is_named(mlp, tmp_path):
    url = f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"
    with pytest.raises(ValueError, match="storage .*missing"):
        study_search(mlp, topology=TOPO, trials=1, trial_proposals=5, storage=url)


def test_a_budget_spent_before_any_trial_ends_returns_the_best_baseline(mlp):
    """The budget is spent on the baselines' scoring: no trial completes (optuna's timeout stops
    the study before its first, or the first is pruned at the study's deadline); the baselines
    enqueued and never run (WAITING, no params) are not trials of the result; the answer is the
    best baseline (it was a RuntimeError)."""
    found = study_search(mlp, topology=TOPO, budget_s=1e-6, seed=1, num_devices_choices=[2])
    assert len(found.trials) <= 1 and all(t.params["num_devices"] == 2 and t.value is None for t in found.trials)
    assert len(found.baselines) >= 2
    best = min(found.baselines, key=found.baselines.get)
    assert found.predicted_ms == found.baselines[best] and found.best_params == {}


def test_time_budget_and_device_choices(mlp):
    found = study_search(mlp, topology=TOPO, budget_s=2.0, seed=1, num_devices_choices=[2])
    assert found.elapsed_s < 4.0
    assert {t.params["num_devices"] for t in found.trials} == {2}
    assert found.strategy.num_devices == 2
    with pytest.raises(ValueError, match="num_devices_choices"):
        study_search(mlp, topology=TOPO, trials=1, num_devices_choices=[8])
    with pytest.raises(ValueError, match="budget_s or trials"):
        study_search(mlp, topology=TOPO)
