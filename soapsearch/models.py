"""Resolve a MODEL argument: a zoo name, ``path/to/file.py:factory`` or ``package.module:factory``
(factory() returns ``(model, example_inputs)``)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from soapsearch import zoo

__all__ = ["ModelSpec", "load_model", "ModelLoadError"]


_TORCH_DIR = os.path.dirname(torch.__file__)


class ModelLoadError(ValueError):
    """A MODEL argument that names nothing loadable."""


@dataclass
class ModelSpec:
    name: str
    model: torch.nn.Module
    example_inputs: tuple[Any, ...]


def _failure(spec: str, what: str, e: BaseException) -> ModelLoadError:
    """``model 'spec': <what> failed: Kind: message (at file:line)``, the line being the
    deepest frame of the user's code (not this file's, importlib's or torch's)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename != __file__ and not f.filename.startswith(("<frozen", _TORCH_DIR))]
    if isinstance(e, SyntaxError):
        frames = []  # its message already says file and line
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    msg = str(e).splitlines()[0] if str(e) else ""
    return ModelLoadError(f"model {spec!r}: {what} failed: {type(e).__name__}: {msg}{at}")


def _factory(spec: str) -> Callable[..., Any]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ModelLoadError(f"model {spec!r}: expected 'path/to/file.py:factory' or "
                             "'package.module:factory', both parts non-empty")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ModelLoadError(f"model {spec!r}: file {target!r} does not exist")
        mod_name = f"_soapsearch_user_{path.stem}"
        loader = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[mod_name] = module
        try:
            loader.loader.exec_module(module)
        except Exception as e:  # a syntax error, a failing import, code that raises at import
            sys.modules.pop(mod_name, None)
            raise _failure(spec, f"loading {target!r}", e) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ModelLoadError(f"model {spec!r}: cannot import module {target!r}: {e}") from None
        except Exception as e:
            raise _failure(spec, f"importing {target!r}", e) from None
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
    try:
        out = fn(**kwargs)
    except Exception as e:  # wrong arguments, or the factory's own error
        raise _failure(spec, "calling the factory", e) from None
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module)):
        raise ModelLoadError(f"model {spec!r}: the factory must return (model, example_inputs), "
                             f"got {type(out).__name__}")
    model, inputs = out
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return ModelSpec(spec.rpartition(":")[2], model, inputs)
