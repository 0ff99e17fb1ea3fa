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


def cli_error(capsys, argv: list[str]) -> str:
    """Run the CLI on ``argv``: it must exit 2 with one error line, ``soapsearch CMD: error: ...``,
    on stderr (no traceback) and nothing on stdout; returns that line."""
    from soapsearch.cli import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"soapsearch {argv[0]}: error: "), err
    return err


@pytest.fixture(scope="session")
def graphs():
    return traced
