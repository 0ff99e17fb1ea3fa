"""One check that delta simulation (the search's Evaluator) scores a plan exactly as a
simulation from scratch, shared by the tests of moves that change several ops at once."""

from simulator.simulate import simulate_plan


def assert_delta_equals_full(evaluate, plan) -> None:
    delta = evaluate(plan, summary=True)
    full = simulate_plan(evaluate.graph, evaluate.planned(plan), evaluate.topology, evaluate.cost,
                         optimizer=evaluate.optimizer, summary=True)
    assert (delta.iteration_time, delta.peak_memory_bytes, delta.busy_time, delta.bytes_moved,
            delta.num_tasks) == (full.iteration_time, full.peak_memory_bytes, full.busy_time,
                                 full.bytes_moved, full.num_tasks)
