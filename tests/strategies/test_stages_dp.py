"""The dynamic-programming stage partitioner (strategies.stages.dp_partition) returns the
optimum of a brute-force search over every split of small sequences of random times."""

import itertools
import random

import pytest

from strategies.stages import dp_partition


def _brute(times, stages):
    n = len(times)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    for n in range(1, 10):
        times = [rng.choice([rng.random(), rng.randint(1, 5), 0.0]) for _ in range(n)]
        for stages in range(1, n + 1):
            starts, slowest = dp_partition(times, stages)
            assert len(starts) == stages and starts[0] == 0 and starts == sorted(set(starts))
            bounds = (*starts, n)
            runs = [sum(times[a:b]) for a, b in zip(bounds, bounds[1:])]
            assert max(runs) == pytest.approx(slowest, abs=1e-12)
            assert slowest == pytest.approx(_brute(times, stages), abs=1e-12), (times, stages)


def test_known_split_and_bad_stages():
    assert dp_partition([1, 1, 1, 1, 4], 2) == ([0, 4], 4)
    assert dp_partition([3, 3, 3, 3, 3, 3], 3) == ([0, 2, 4], 6)
    with pytest.raises(ValueError, match="stages = 4: must be between 1 and the 3 units to split"):
        dp_partition([1.0, 2.0, 3.0], 4)
