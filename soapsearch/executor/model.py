"""The model every rank builds identically: same factory, same seed, same dtype, then traced
into the OpGraph the plan's fingerprint is checked against."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from soapsearch import zoo
from soapsearch.models import load_model
from soapsearch.trace import trace_with_module
from strategies.graph import OpGraph

__all__ = ["TrainModel", "build_model"]


@dataclass
class TrainModel:
    model: torch.nn.Module
    inputs: tuple[Any, ...]
    """The model's positional arguments (the batch each step trains on)."""
    graph: OpGraph
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    """The tensors training starts from: the model's ``state_dict`` and every weight an op
    names that it lacks (a non-persistent buffer such as a rotary ``inv_freq``, a constant
    torch.export lifted out of forward), by ``Weight.name``."""

    def saved(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (an Executor's ``state_dict()``) cut to the model's own ``state_dict``
        keys, loadable with ``model.load_state_dict``."""
        keys = self.model.state_dict().keys()
        return {k: v for k, v in state.items() if k in keys}


def _state(model: torch.nn.Module, graph: OpGraph, captured: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    for node in graph:
        for w in node.weights:
            if w.name not in state:
                mod_path, _, attr = w.name.rpartition(".")
                state[w.name] = getattr(captured.get_submodule(mod_path) if mod_path else captured, attr)
    return state


def build_model(spec: str, variant: str = "default", batch_size: int | None = None, seed: int = 0,
                dtype: str | None = None, device: str = "cpu", capture: str = "auto") -> TrainModel:
    """Build MODEL (a zoo name or ``file.py:factory`` / ``module:factory``) for real on the CPU
    with ``seed``, cast its floating weights and inputs to ``dtype`` if given, and trace it.
    ``device="meta"`` builds a zoo model without its weights (the same graph, for checks only);
    a factory's model is built on the CPU whatever ``device`` says (the factory makes it).
    ``capture`` is the front end ``trace`` captures it with (a plan's ``model.capture``)."""
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
    graph, captured = trace_with_module(model, inputs, name=name, capture=capture)
    return TrainModel(model, inputs, graph, _state(model, graph, captured))
