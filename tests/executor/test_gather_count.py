"""The executor's level-3 all-gathers, counted on 2 gloo processes (each
``all_gather_into_tensor`` call and its bytes), equal the simulator's all-gather tasks for the
same plan (``simulator.zero3``): per-op units and layer units (``fsdp_unit`` "block"), with and
without recompute. Under layer units a layer recomputed within itself (``rc_layers``: all but
its closing residual add, the chain recomputed at that add's backward step) is gathered once for
its recomputation and backward (``strategies.prefetch.recomputed_in_unit``, FSDP2's
``_pre_forward`` returning early in the backward): the step's bytes equal those of no recompute."""

from __future__ import annotations


import pytest
import torch.distributed as dist

from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.tasks import build_tasks
from simulator.taskgraph import label
from soapsearch.executor import build_model
from strategies.lowering import lower
from tests.executor.counted import save_counted_steps
from tests.executor.gloo import spawn_ranks
from tests.executor.plans import make_plan

pytestmark = pytest.mark.distributed

WORLD = 2
PLANS = ("zero3_dp", "zero3_dp+rc_layers", "unitblock_zero3_dp", "unitblock_zero3_dp+rc_layers",
         "unitblock_zero3_dp+rc_blocks", "unitblock_zero3_dp_mb2+rc_mlp")


def _count(rank: int, world: int, port: int, out: str) -> None:
    save_counted_steps(rank, world, port, out, PLANS, dist, "all_gather_into_tensor",
                       lambda output, *args, **kwargs: output.numel() * output.element_size())


def _simulated(graph, name: str) -> list[int]:
    """The bytes of each all-gather task the simulator charges for plan ``name``."""
    low = lower(graph, make_plan(graph, name, WORLD))
    tg = build_tasks(low, get_topology("p100-2x2"), get_cost_model("analytical"))
    return [int(b) for x, b in zip(tg.name, tg.nbytes) if label(x).startswith("allgather ")]


def test_executor_gathers_what_the_simulator_charges():
    logs = spawn_ranks(_count, WORLD)
    g = build_model("gpt", "tiny", dtype="float64").graph
    for name in PLANS:
        sim = sorted(_simulated(g, name))
        for r in range(WORLD):
            assert sorted(logs[r][name]) == sim, (name, r, sum(logs[r][name]), sum(sim))
    total = {name: sum(logs[0][name]) for name in PLANS}
    # gpt tiny's level-3 weights, 2 layers of 13,120 B and the rest, gathered in both passes
    assert total["zero3_dp"] == total["unitblock_zero3_dp"] == 133_120
    assert total["zero3_dp+rc_layers"] == 133_120 + 2 * 2 * 13_120  # per op: each layer gathered again
    assert total["unitblock_zero3_dp+rc_layers"] == 133_120  # per layer: once for recompute and backward
    # rc_blocks' chain runs through layer 0 into layer 1: layer 0's recomputation in layer 1's unit
    assert total["unitblock_zero3_dp+rc_blocks"] == 133_120 + 2 * 13_120
    assert len(logs[0]["unitblock_zero3_dp"]) == len(logs[0]["unitblock_zero3_dp+rc_layers"]) == 12
