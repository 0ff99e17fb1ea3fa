"""The longer cases of ``test_parity_buckets`` (gpt data parallel with 2 micro-batches at an 8 KiB
cap; gpt at ZeRO level 3 with layer units at 2 micro-batches and with every layer op
recomputed, and every layer op but its closing residual add, gathered once for its
recomputation and backward), 2 gloo processes, float64, SGD and Adam, against one device;
under ``pytest -m slow``, keeping the README's test command within CI's time."""

from __future__ import annotations

import pytest

from tests.executor.harness import parity_tests
from tests.executor.test_parity_buckets import SLOW_2

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

results2, _, test_parity_2_processes, _ = parity_tests(SLOW_2, [])
