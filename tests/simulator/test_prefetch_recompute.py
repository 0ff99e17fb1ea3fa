"""A recomputed op's level-3 all-gathers under ZeRO-3 units (``simulator.zero3``,
``strategies.prefetch.recomputed_in_unit``): with layer units (``fsdp_unit`` "block", FSDP2's
``fully_shard`` per layer) a layer recomputed within itself is gathered once for its
recomputation and its backward (FSDP2's ``_pre_forward`` returns early in the backward), so
the step's all-gather bytes equal those without recompute; with units of one op it is gathered
again. Delta simulation equals full and the folded simulation the per-device one on such plans.
The executor's gathers, counted: ``tests/executor/test_gather_count.py``."""


from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from simulator.taskgraph import label
from strategies import baseline
from strategies.lowering import lower
from strategies.megatron_layers import layer_ops, layer_recomputed
from strategies.prefetch import recomputed_in_unit
from strategies.zero import gather_groups
from tests.conftest import traced
from tests.executor.plans import recompute, recompute_ops
from tests.simulator.delta_walk import delta_walk, fold_equals_full

COST = get_cost_model("analytical")


def _gathered(low, topology: str = "a100-1x8") -> tuple[int, int]:
    """(all-gather tasks, their bytes) of one simulation of ``low``."""
    tg = build_tasks(low, get_topology(topology), COST)
    out = [int(b) for x, b in zip(tg.name, tg.nbytes) if label(x).startswith("allgather ")]
    return len(out), sum(out)


def _recomputed(graph, n: int, every: int = 1):
    """The ``fsdp`` baseline on ``n`` devices with every ``every``-th layer recomputed (all its
    ops but the closing residual add: Megatron-LM's and torchtitan's full recompute)."""
    plan = baseline("fsdp", graph, n)
    return plan, layer_recomputed(plan, graph, layer_ops(graph)[every - 1::every])


def test_layer_units_gather_a_recomputed_layer_once():
    """LLaMA on 8 devices: each layer's weights gathered in one call per pass; with every
    second layer recomputed the calls and bytes are those of no recompute, and every
    recomputed weighted op is recomputed in its own unit. Units of one op gather a recomputed
    layer's groups a third time: its bytes once more, one call per group."""
    graph = traced("llama", batch_size=8)
    plan, again = _recomputed(graph, 8, 2)
    assert plan.fsdp_unit == "block"
    low, low_again = lower(graph, plan), lower(graph, again)
    readers = {u.op for u in gather_groups(low_again) if u.zero == 3 and again[u.op].recompute}
    assert readers and recomputed_in_unit(low_again) == readers
    assert _gathered(low_again) == _gathered(low)
    by_op, by_op_again = lower(graph, plan.with_fsdp_unit("op")), lower(graph, again.with_fsdp_unit("op"))
    assert recomputed_in_unit(by_op_again) == frozenset()
    redone = [u for u in gather_groups(by_op_again) if u.op in readers]
    calls, nbytes = _gathered(by_op)
    assert _gathered(by_op_again) == (calls + len(redone), nbytes + sum(u.chunk_bytes * len(u.devices)
                                                                        for u in redone))


def test_a_chain_into_the_next_layer_is_gathered_again():
    """gpt with every op of both layers recomputed (the closing residual adds too): layer 0's
    chain runs into layer 1 and is recomputed at layer 1's backward step, another unit, so
    layer 0 is gathered twice in the backward and only layer 1 once."""
    graph = traced("gpt")
    plan = baseline("fsdp", graph, 2)
    every = recompute(plan, recompute_ops(graph, "blocks"))
    low = lower(graph, every)
    weighted = {u.op for u in gather_groups(low) if u.zero == 3}
    assert recomputed_in_unit(low) == {op for op in weighted if op.startswith("blocks_1_")}
    layer0 = sum(u.chunk_bytes * len(u.devices) for u in gather_groups(low) if u.op.startswith("blocks_0_"))
    calls, nbytes = _gathered(lower(graph, plan), "p100-2x2")
    assert _gathered(low, "p100-2x2") == (calls, nbytes + layer0)


def test_delta_equals_full_with_recomputed_layers():
    graph = traced("gpt", batch_size=16)
    walked = delta_walk(graph, "p100-2x2", lambda n: _recomputed(graph, n)[1], (0, 3, 3), seed=5)
    assert len(walked) >= 10 and any(recomputed_in_unit(low) for low in walked)


def test_delta_equals_full_with_recompute_switched_op_by_op():
    """Recompute switched on the readers of layer units one op at a time, from every op of both
    gpt layers recomputed (layer 0's chains run into layer 1: its readers recompute outside
    ``recomputed_in_unit``)."""
    graph = traced("gpt", batch_size=16)
    walked = delta_walk(graph, "p100-2x2", lambda n: recompute(baseline("fsdp", graph, n), recompute_ops(
        graph, "blocks")), (3,), seed=1, steps=24, toggle=0.8)  # layer 0's chains run into layer 1
    assert len(walked) >= 12 and len({recomputed_in_unit(low) for low in walked}) >= 3


def test_folded_equals_per_device_with_recomputed_layers():
    graph = traced("llama", batch_size=16)
    fold_equals_full(graph, _recomputed(graph, 16, 2)[1], "a100-2x8", COST)
