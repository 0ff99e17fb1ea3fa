"""``simulator.heap``: the trim returns freed malloc memory to the OS on glibc (the process's
resident pages, /proc/self/statm, fall across the call), does nothing and raises nothing where
the C library is not glibc, and runs only after simulations of ``TRIM_FROM`` tasks or more."""

from __future__ import annotations

import os
import sys

import pytest

from simulator import heap
from simulator.cost import get_cost_model
from simulator.presets import get_topology
from simulator.simulate import simulate_plan
from simulator.tasks import TaskCache
from strategies import data_parallel
from tests.conftest import traced


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    heap._malloc_trim.cache_clear()
    try:
        assert heap._malloc_trim() is None
        calls = heap.TRIMS.calls
        assert heap.trim() is False
        assert heap.trimmed(heap.TRIM_FROM) is False
        assert heap.TRIMS.calls == calls  # nothing called
    finally:
        monkeypatch.undo()
        heap._malloc_trim.cache_clear()


def test_no_op_where_the_library_has_no_malloc_trim(monkeypatch):
    def no_library(*args, **kwargs):
        raise OSError("no C library")
    monkeypatch.setattr(heap.ctypes, "CDLL", no_library)
    heap._malloc_trim.cache_clear()
    try:
        assert heap._malloc_trim() is None
        assert heap.trim() is False
    finally:
        monkeypatch.undo()
        heap._malloc_trim.cache_clear()


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None,
                    reason="malloc_trim is glibc's (Linux)")
def test_trim_returns_freed_memory_on_glibc():
    block, count = 100_000, 3000  # 300 MB of blocks below the mmap threshold: from the arena
    blocks, pins = [], []
    for _ in range(count):
        blocks.append(bytearray(block))
        pins.append(bytearray(600))  # a small block after each keeps the freed ones off the heap's top
    for b in blocks:
        b[::4096] = b"\1" * len(range(0, block, 4096))  # every page resident
    del blocks
    freed = _resident_bytes()
    assert heap.trim() is True
    fell = freed - _resident_bytes()
    assert fell >= block * count // 2, f"resident bytes fell by {fell}, not half of {block * count}"
    del pins


def test_trimmed_only_from_trim_from_tasks(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    assert heap.trimmed(heap.TRIM_FROM - 1) is False and not calls
    assert heap.trimmed(heap.TRIM_FROM) is True and len(calls) == 1


def test_simulate_plan_trims_after_a_simulation_of_trim_from_tasks(monkeypatch):
    graph = traced("gpt", batch_size=16)
    plan = data_parallel(graph, 4)
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    tasks = simulate_plan(graph, plan, "p100-2x2").num_tasks
    assert not calls  # far below TRIM_FROM
    monkeypatch.setattr(heap, "TRIM_FROM", tasks + 1)
    simulate_plan(graph, plan, "p100-2x2")
    assert not calls
    monkeypatch.setattr(heap, "TRIM_FROM", tasks)
    simulate_plan(graph, plan, "p100-2x2")
    assert len(calls) == 1
    topo, cost = get_topology("p100-2x2"), get_cost_model("analytical")
    simulate_plan(graph, plan, topo, cost, cache=TaskCache(topo, cost))  # the cache's owner trims
    assert len(calls) == 1
