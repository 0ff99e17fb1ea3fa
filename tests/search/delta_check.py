"""One check that delta simulation (the search's Evaluator) scores a plan exactly as a
simulation from scratch, shared by the tests of moves that change several ops at once."""

from simulator.simulate import simulate_plan


def assert_same_result(got, want, context=None) -> None:
    """Two simulations' figures agree to the bit (``context`` names the case on failure)."""
    assert (got.iteration_time, got.peak_memory_bytes, got.busy_time, got.bytes_moved,
            got.num_tasks) == (want.iteration_time, want.peak_memory_bytes, want.busy_time,
                               want.bytes_moved, want.num_tasks), context


def assert_delta_equals_full(evaluate, plan, context=None) -> None:
    delta = evaluate(plan, summary=True)
    full = simulate_plan(evaluate.graph, evaluate.planned(plan), evaluate.topology, evaluate.cost,
                         optimizer=evaluate.optimizer, summary=True)
    assert_same_result(delta, full, context)
