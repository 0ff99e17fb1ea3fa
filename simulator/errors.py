"""The one-line error every topology check raises: where, the field, its value and the rule."""

from __future__ import annotations

from typing import Any

__all__ = ["field_error"]


def field_error(where: str, what: str, value: Any, rule: str) -> ValueError:
    """``ValueError("<where>: <what> = <value!r>: <rule>")``."""
    return ValueError(f"{where}: {what} = {value!r}: {rule}")
