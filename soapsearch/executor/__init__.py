"""The executor: trains a model with any valid plan for real on torch.distributed, one process
per device, equal to one device (docs/design.md, "Executor")."""

from soapsearch.executor.config import OPTIMIZERS, TrainConfig, make_optimizer
from soapsearch.executor.errors import ExecutorError, check_runnable
from soapsearch.executor.model import TrainModel, build_model
from soapsearch.executor.runtime import Executor

__all__ = ["Executor", "ExecutorError", "OPTIMIZERS", "TrainConfig", "TrainModel", "build_model",
           "check_runnable", "make_optimizer"]
