"""What a plan is: the OpGraph IR and op rules, ParallelConfig and Strategy, their JSON, and the
baseline plans. The bottom layer: imports neither ``simulator`` nor ``soapsearch``."""

from strategies.baselines import (BASELINES, balanced_stages, baseline, data_parallel, hybrid,
                                  model_parallel, owt, pipeline)
from strategies.config import ParallelConfig, enumerate_configs, validate_config
from strategies.errors import PlanError
from strategies.graph import Dim, OpGraph, OpNode, TensorSpec, Weight
from strategies.region import Box
from strategies.rules import OpRule, Reduction, get_rule
from strategies.serialize import PlanFile, load_strategy, read_plan, save_strategy, strategy_to_json
from strategies.strategy import SCHEDULES, Strategy

__all__ = [
    "BASELINES", "Box", "Dim", "OpGraph", "OpNode", "OpRule", "ParallelConfig", "PlanError",
    "PlanFile", "Reduction", "SCHEDULES", "Strategy", "TensorSpec", "Weight", "balanced_stages",
    "baseline", "data_parallel", "enumerate_configs", "get_rule", "hybrid", "load_strategy",
    "model_parallel", "owt", "pipeline", "read_plan", "save_strategy", "strategy_to_json",
    "validate_config",
]
