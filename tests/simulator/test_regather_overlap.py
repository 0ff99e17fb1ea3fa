"""The all-gather a linear calls again in its backward (``strategies.collective_buffers``:
``BufferLife.regather``) runs beside its input-gradient product under Megatron-LM's
asynchronous tensor-parallel communication (``CostModel.input_grad_overlap``;
``LinearWithGradAccumulationAndAsyncCommunication.backward`` starts it, computes
``grad_output.matmul(weight)``, then waits): charged what half the shortest reader's backward
leaves, and in full without the overlap."""

from simulator.collectives import hidden_by_readers
from simulator.comm import collective_time
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from strategies.collective_buffers import buffer_lives
from tests.strategies.test_regather import _selective_sp


def _again(tg) -> dict[str, float]:
    return {tg.label(t): tg.duration[t] for t in range(len(tg)) if " again " in tg.label(t)}


def test_gathered_again_beside_the_input_gradient():
    g, lowered = _selective_sp()
    topo = get_topology("a100-1x2")
    plain = get_cost_model("analytical", attention="megatron")
    overlap = get_cost_model("analytical", attention="megatron", input_grad_overlap=True)
    before, after = _again(build_tasks(lowered, topo, plain)), _again(build_tasks(lowered, topo, overlap))
    readers = lowered.collective_readers
    lives = [life for life in buffer_lives(lowered) if life.regather is not None]
    assert len(lives) == 5 and len(before) == 5 and before.keys() == after.keys()
    for life in lives:
        c = life.collective
        label = f"all_gather again {c.op}@mb{c.microbatch} devices {','.join(map(str, c.devices))}"
        full = collective_time(topo, "all_gather", c.devices, c.nbytes)
        # by hand: half the shortest linear reader's backward (its 2F: input and weight gradients)
        hidden = min(overlap.partition_time(lowered.graph[r.dst_op],
                                            lowered.pieces[r.dst_op].partitions[c.microbatch][r.dst_index],
                                            topo.devices[r.device])[1] / 2 for r in readers[c])
        assert hidden > 0 and hidden_by_readers(lowered, readers[c], topo, overlap) == hidden
        assert before[label] == full > 0
        assert after[label] == max(0.0, full - hidden)
