"""One error type for every invalid plan, naming the op, the field, the value and the rule."""

from __future__ import annotations

from typing import Any

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan (or a piece of one) that breaks a rule: ``op 'fc1': degrees = [1, 3]: degree 3
    on dim 'out_features'(4096) does not divide it``."""

    def __init__(self, op: str | None, field: str, value: Any, rule: str, where: str = ""):
        self.op, self.field, self.value, self.rule, self.where = op, field, value, rule, where
        head = f"{where}: " if where else ""
        who = f"op {op!r}: " if op is not None else ""
        super().__init__(f"{head}{who}{field} = {value!r}: {rule}")

    def __reduce__(self):
        """Rebuilt from its five fields, so that it crosses a process boundary (a search's
        worker processes send it back to the parent) as the same error."""
        return (type(self), (self.op, self.field, self.value, self.rule, self.where))
