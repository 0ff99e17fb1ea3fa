"""SearchConfig: one frozen dataclass holds every knob of a search and its default; search()
and study_search() take it (or keyword arguments naming its fields) and the CLI builds it."""

import dataclasses
import math

import pytest

from soapsearch import SearchConfig, search
from soapsearch.cli import _parser
from soapsearch.search.cli import config_of
from tests.conftest import traced


@pytest.mark.parametrize("kw, message", [
    (dict(proposals=0), r"^budget proposals = 0: must be a whole number >= 1$"),
    (dict(budget_s=math.nan), r"^budget seconds = nan: must be a finite number > 0$"),
    (dict(num_devices=0), r"^search num_devices = 0: must be a whole number >= 1$"),
    (dict(microbatches=1.5), r"^search microbatches = 1.5: must be a whole number >= 1$"),
    (dict(reset_every=-1), r"^search reset_every = -1: must be a whole number >= 0$"),
    (dict(seed="1"), r"^search seed = '1': must be a whole number$"),
    (dict(beta=0.0), r"^search beta = 0.0: must be a finite number > 0 \(per ms\) or None$"),
    (dict(schedule="zigzag"), r"^search schedule = 'zigzag': must be one of \['gpipe', '1f1b'\]$"),
    (dict(init=()), r"^search needs at least one initial plan \(init\)$"),
    (dict(optimizer="lamb"), r"^search optimizer = 'lamb': must be one of \['sgd', 'adam'\]$"),
])
def test_each_field_is_checked_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(**kw)


def test_a_config_is_frozen_and_one_initial_plan_is_a_tuple_of_one():
    config = SearchConfig(init="owt")
    assert config.init == ("owt",) and SearchConfig(init=["owt", "random"]).init == ("owt", "random")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    assert SearchConfig(budget_s=None, proposals=None).proposals is None  # a study may stop after its trials


def test_a_config_and_keywords_find_the_same_plan():
    g = traced("mlp")
    config = SearchConfig(budget_s=None, proposals=60, seed=2, init=("owt", "random"), workers=1)
    by_config = search(g, topology="p100-1x2", config=config)
    by_keywords = search(g, topology="p100-1x2", budget_s=None, proposals=60, seed=2, init=("owt", "random"),
                         workers=1)
    assert by_config.strategy == by_keywords.strategy
    assert by_config.proposals == by_keywords.proposals and by_config.accepted == by_keywords.accepted
    overridden = search(g, topology="p100-1x2", config=config, seed=3)  # a keyword replaces its field
    assert overridden.strategy == search(g, topology="p100-1x2", config=dataclasses.replace(config, seed=3)).strategy
    with pytest.raises(TypeError, match=r"search\(\) got an unexpected keyword argument 'budget'; SearchConfig's"):
        search(g, topology="p100-1x2", budget=5)
    with pytest.raises(ValueError, match=r"needs seconds or proposals"):
        search(g, topology="p100-1x2", config=SearchConfig(budget_s=None))


def test_the_cli_defaults_are_the_config_s():
    args = _parser().parse_args(["search", "mlp"])
    assert config_of(args, SearchConfig.cost_model) == SearchConfig()
    args = _parser().parse_args(["search", "mlp", "--budget", "0", "--proposals", "7", "--init", "owt,random",
                                 "--seed", "4", "--microbatches", "2", "--schedule", "1f1b", "--devices", "2",
                                 "--chains", "3", "--workers", "1", "--optimizer", "adam"])
    assert config_of(args, "analytical") == SearchConfig(
        budget_s=None, proposals=7, init=("owt", "random"), seed=4, microbatches=2, schedule="1f1b",
        num_devices=2, chains=3, workers=1, optimizer="adam")
