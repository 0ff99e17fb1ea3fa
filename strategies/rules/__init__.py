"""Op rules: for each op kind, which dims may be cut, what each partition reads and how it
computes its piece. Importing this package registers every rule."""

from strategies.rules.base import (OPAQUE, OpRule, Reduce, Reduction, get_rule, no_reduce,
                                   register, rule_kinds)
from strategies.rules import conv, dense, loss, norm, opaque, pointwise, recurrent, shape  # noqa: F401
from strategies.rules import gather, mask, rms_norm, scan  # noqa: F401  (the LLM ops, scans)
from strategies.rules import scatter  # noqa: F401  (x[:, 1:] = y, out of place)

__all__ = ["OPAQUE", "OpRule", "Reduce", "Reduction", "get_rule", "no_reduce", "register",
           "rule_kinds"]
