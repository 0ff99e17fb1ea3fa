"""Megatron-LM's asynchronous tensor-parallel communication (``CostModel.input_grad_overlap``,
simulator/collectives.py): the collective reducing a column-parallel linear's input gradient runs
beside its weight-gradient product, so it is charged what that product (half the linear's
backward) leaves; a dual whose readers have no parameters is charged in full."""

from simulator.collectives import hidden_by_readers
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import build_tasks
from strategies.lowering import lower
from strategies.megatron import megatron
from tests.conftest import traced


def _grad_collectives(tg):
    return {tg.label(t): tg.duration[t] for t in range(len(tg)) if " grad " in tg.label(t)}


def test_dual_charged_what_the_weight_gradient_leaves():
    g = traced("gpt")
    plan = megatron(g, 2, tp=2, sequence_parallel=True)
    lowered = lower(g, plan)
    topo = get_topology("a100-1x2")
    plain = get_cost_model("analytical", attention="megatron")
    overlap = get_cost_model("analytical", attention="megatron", input_grad_overlap=True)
    before, after = _grad_collectives(build_tasks(lowered, topo, plain)), _grad_collectives(build_tasks(lowered, topo, overlap))
    assert before.keys() == after.keys()
    readers = lowered.collective_readers
    shortened = 0
    for c in lowered.collectives:
        if not c.grad:
            continue
        label = f"{c.backward_kind} grad {c.op}@mb{c.microbatch} devices {','.join(map(str, c.devices))}"
        reads = readers[c]
        weighted = {lowered.graph[r.dst_op].kind for r in reads} == {"linear"}
        if weighted:  # by hand: half the linear's backward (its 2F: input and weight gradients)
            hidden = min(overlap.partition_time(lowered.graph[r.dst_op],
                                                lowered.pieces[r.dst_op].partitions[c.microbatch][r.dst_index],
                                                topo.devices[r.device])[1] / 2 for r in reads)
            assert hidden > 0 and hidden_by_readers(lowered, reads, topo, overlap) == hidden
            assert after[label] == max(0.0, before[label] - hidden)
            shortened += after[label] < before[label]
        else:  # a row-parallel output's reduce-scatter, read by dropout: its all-gather in full
            assert hidden_by_readers(lowered, reads, topo, overlap) == 0.0 and after[label] == before[label]
    assert shortened >= 4  # q/k/v's and the MLP's input gradients, both layers
    t_plain = simulate_plan(g, lowered, topo, plain, optimizer="adam", summary=False).iteration_time
    t_overlap = simulate_plan(g, lowered, topo, overlap, optimizer="adam", summary=False).iteration_time
    assert t_overlap < t_plain
