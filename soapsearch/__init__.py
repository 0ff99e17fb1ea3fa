"""soapsearch: find a fast way to train one PyTorch model on many devices (FlexFlow's SOAP
search), then train it that way.

    graph = soapsearch.trace(model, (inputs, targets))        # model -> OpGraph
    plan = soapsearch.baseline("owt", graph, num_devices=4)    # a Strategy
    soapsearch.save_strategy("plan.json", plan, graph)         # JSON v1
    result = soapsearch.simulate(graph, plan, topology="p100-1x4")  # SimResult
"""

from soapsearch import zoo
from soapsearch.api import simulate
from soapsearch.search import SearchResult, search
from soapsearch.models import ModelLoadError, ModelSpec, load_model
from soapsearch.trace import TraceError, trace
from strategies import (BASELINES, OpGraph, ParallelConfig, PlanError, Strategy, baseline,
                        enumerate_configs, load_strategy, read_plan, save_strategy)

__all__ = [
    "BASELINES", "ModelLoadError", "ModelSpec", "OpGraph", "ParallelConfig", "PlanError",
    "SearchResult", "Strategy", "TraceError", "baseline", "enumerate_configs", "load_model", "load_strategy",
    "read_plan", "save_strategy", "search", "simulate", "trace", "zoo",
]
