"""Resolve a MODEL argument: a zoo name, ``path/to/file.py:factory`` or ``package.module:factory``
(factory() returns ``(model, example_inputs)``)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from soapsearch import zoo

__all__ = ["ModelSpec", "load_model", "ModelLoadError"]


class ModelLoadError(ValueError):
    """A MODEL argument that names nothing loadable."""


@dataclass
class ModelSpec:
    name: str
    model: torch.nn.Module
    example_inputs: tuple[Any, ...]


def _factory(spec: str) -> Callable[..., Any]:
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ModelLoadError(f"model {spec!r}: file {target!r} does not exist")
        mod_name = f"_soapsearch_user_{path.stem}"
        loader = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = module
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ModelLoadError(f"model {spec!r}: cannot import module {target!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ModelLoadError(f"model {spec!r}: {target!r} has no callable {attr!r}")
    return fn


def load_model(spec: str, *, variant: str = "default", batch_size: int | None = None,
               device: str | torch.device | None = None) -> ModelSpec:
    """The model and example inputs MODEL names. Zoo models of the ``default`` (paper-scale)
    variant are built on the meta device unless ``device`` says otherwise, so planning never
    allocates their weights."""
    if ":" not in spec:
        if spec not in zoo.names():
            raise ModelLoadError(f"model {spec!r} is not a zoo model {list(zoo.names())} "
                                 "nor a 'file.py:factory' / 'package.module:factory'")
        if device is None and variant == "default":
            device = "meta"
        model, inputs = zoo.build(spec, variant, batch_size=batch_size, device=device)
        return ModelSpec(spec if variant == "default" else f"{spec}-{variant}", model, tuple(inputs))
    fn = _factory(spec)
    kwargs = {}
    if batch_size is not None:
        if "batch_size" not in inspect.signature(fn).parameters:
            raise ModelLoadError(f"model {spec!r}: --batch-size given but the factory takes no "
                                 "batch_size argument")
        kwargs["batch_size"] = batch_size
    out = fn(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module)):
        raise ModelLoadError(f"model {spec!r}: the factory must return (model, example_inputs), "
                             f"got {type(out).__name__}")
    model, inputs = out
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return ModelSpec(spec.rpartition(":")[2], model, inputs)
