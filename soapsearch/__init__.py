"""soapsearch: find a fast way to train one PyTorch model on many devices (FlexFlow's SOAP
search), then train it that way.

    graph = soapsearch.trace(model, (inputs, targets))        # model -> OpGraph
    plan = soapsearch.baseline("owt", graph, num_devices=4)    # a Strategy
    soapsearch.save_strategy("plan.json", plan, graph)         # JSON v1
    result = soapsearch.simulate(graph, plan, topology="p100-1x4")  # SimResult
    config = soapsearch.SearchConfig(budget_s=10, seed=1)      # every knob of a search
    found = soapsearch.search(graph, topology="p100-1x4", config=config)  # SearchResult

A topology defaults to ``DEFAULT_TOPOLOGY`` (p100-4x4) wherever one is taken.
"""

from soapsearch import zoo
from soapsearch.api import DEFAULT_TOPOLOGY, simulate
from soapsearch.search import SearchConfig, SearchResult, search
from soapsearch.models import ModelLoadError, ModelSpec, load_model
from soapsearch.trace import TraceError, trace
from strategies import (BASELINES, OpGraph, ParallelConfig, PlanError, Strategy, baseline,
                        enumerate_configs, load_strategy, read_plan, save_strategy)

__all__ = [
    "BASELINES", "DEFAULT_TOPOLOGY", "ModelLoadError", "ModelSpec", "OpGraph", "ParallelConfig",
    "PlanError", "SearchConfig", "SearchResult", "Strategy", "TraceError", "baseline",
    "enumerate_configs", "load_model", "load_strategy", "read_plan", "save_strategy", "search",
    "simulate", "trace", "zoo",
]
