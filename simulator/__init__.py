"""What a plan costs: device topology, cost models (analytical roofline, profiled), the task
graph built from the shared lowering, event simulation, memory and Chrome-trace timelines.
Imports ``strategies`` only, never ``soapsearch``."""

from simulator.comm import allreduce_time, ring_links, transfer_time
from simulator.cost import AnalyticalCostModel, CostModel, get_cost_model
from simulator.devices import DeviceSpec, Link
from simulator.presets import get_topology
from simulator.profiled import ProfiledCostModel
from simulator.result import SimResult, chrome_trace
from simulator.simulate import simulate_plan
from simulator.topology import Topology

__all__ = [
    "AnalyticalCostModel", "CostModel", "DeviceSpec", "Link", "ProfiledCostModel", "SimResult",
    "Topology", "allreduce_time", "chrome_trace", "get_cost_model", "get_topology", "ring_links",
    "simulate_plan", "transfer_time",
]
