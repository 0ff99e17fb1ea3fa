"""``Strategy``'s hash is its compared fields', kept after the first ask, and left behind when
the plan is pickled (a string's hash differs from process to process)."""

import pickle

from strategies.config import ParallelConfig
from strategies.strategy import Strategy


def test_the_hash_is_the_fields_kept_and_not_pickled():
    a = Strategy.of({"x": ParallelConfig((2,), (0, 1)), "y": ParallelConfig((1,), (0,))}, 2)
    b = Strategy.of({"x": ParallelConfig((2,), (0, 1)), "y": ParallelConfig((1,), (0,))}, 2)
    assert "_hash" not in a.__dict__
    assert hash(a) == hash(b) == hash((a.configs, 2, 1, "gpipe", "model", 25.0, "op", "compute", True)) and a == b
    assert a.__dict__["_hash"] == hash(a)
    others = [a.replace("y", ParallelConfig((1,), (1,))), a.with_microbatches(2), a.with_precision("bf16"),
              a.with_precision("bf16", "float32"), a.with_overlap_grad_reduce(False)]
    assert len({a, b, *others}) == 6
    copy = pickle.loads(pickle.dumps(a))
    assert "_hash" not in copy.__dict__ and copy == a and hash(copy) == hash(a)
