import functools

import pytest

from soapsearch import zoo
from soapsearch.trace import trace


@functools.lru_cache(maxsize=None)
def traced(name: str, variant: str = "tiny", batch_size: int | None = None):
    """The OpGraph of a zoo model (cached: tracing is the slow part of planning tests)."""
    model, inputs = zoo.build(name, variant, batch_size=batch_size,
                              device="meta" if variant == "default" else None)
    return trace(model, inputs, name=name)


@pytest.fixture(scope="session")
def graphs():
    return traced
