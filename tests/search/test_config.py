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


def test_the_cli_sets_the_move_rates_and_the_temperature_fields():
    args = _parser().parse_args(["search", "mlp", "--beta", "0.5", "--replicas", "2", "--reset-every", "0",
                                 "--microbatch-choices", "1,4", "--zero-move", "0.1", "--recompute-move", "0",
                                 "--microbatch-move", "0.3", "--subgraph-move", "0.2", "--repeat-move", "0.4",
                                 "--global-move", "0.5", "--repeat-stages"])
    assert config_of(args, "analytical") == SearchConfig(
        beta=0.5, replicas=2, reset_every=0, microbatch_choices=(1, 4), zero_move=0.1, recompute_move=0.0,
        microbatch_move=0.3, subgraph_move=0.2, repeat_move=0.4, global_move=0.5, repeat_stages=True)


@pytest.mark.parametrize("argv, message", [
    (["--zero-move", "0.9", "--subgraph-move", "0.2"],
     "search zero_move + recompute_move + microbatch_move + subgraph_move = 0.9 + 0.05 + 0.02 + 0.2 = 1.17: "
     "the probabilities of a proposal's kinds must sum to at most 1"),
    (["--global-move", "2"], "search global_move = 2.0: a probability is a number in [0, 1]"),
    (["--microbatch-choices", "1,two"], "search microbatch_choices = '1,two': must be a comma list of whole numbers, e.g. 1,2,4,8"),
    (["--replicas", "0"], "search replicas = 0: must be a whole number >= 1"),
])
def test_bad_search_flags_are_one_line(capsys, argv, message):
    from tests.conftest import cli_error
    assert message in cli_error(capsys, ["search", "mlp", "--variant", "tiny", *argv])
