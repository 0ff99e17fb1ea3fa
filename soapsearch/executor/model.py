"""The model every rank builds identically: same factory, same seed, same dtype, then traced
into the OpGraph the plan's fingerprint is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from soapsearch import zoo
from soapsearch.models import load_model
from soapsearch.trace import trace
from strategies.graph import OpGraph

__all__ = ["TrainModel", "build_model"]


@dataclass
class TrainModel:
    model: torch.nn.Module
    inputs: tuple[Any, ...]
    """The model's positional arguments (the batch each step trains on)."""
    graph: OpGraph


def build_model(spec: str, variant: str = "default", batch_size: int | None = None, seed: int = 0,
                dtype: str | None = None, device: str = "cpu") -> TrainModel:
    """Build MODEL (a zoo name or ``file.py:factory`` / ``module:factory``) for real on the CPU
    with ``seed``, cast its floating weights and inputs to ``dtype`` if given, and trace it.
    ``device="meta"`` builds a zoo model without its weights (the same graph, for checks only);
    a factory's model is built on the CPU whatever ``device`` says (the factory makes it)."""
    if spec in zoo.names():
        model, inputs = zoo.build(spec, variant, batch_size=batch_size, device=device, seed=seed)
        inputs = tuple(inputs)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            loaded = load_model(spec, variant=variant, batch_size=batch_size, device="cpu")
        model, inputs = loaded.model, loaded.example_inputs
    if dtype is not None:
        dt = getattr(torch, dtype)
        model = model.to(dt)
        inputs = tuple(x.to(dt) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                       for x in inputs)
    # named as ``soapsearch.models.load_model`` names it (a plan records the name): the zoo
    # name, with the variant unless it is the default
    name = f"{spec}-{variant}" if spec in zoo.names() and variant != "default" else spec
    graph = trace(model, inputs, name=name)
    return TrainModel(model, inputs, graph)
