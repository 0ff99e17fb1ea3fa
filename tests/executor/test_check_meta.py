"""``soapsearch run``'s check in the launching process builds a zoo model on the meta device:
the graph, and so the fingerprint a plan is checked against, is the one every rank traces."""

from __future__ import annotations

import pytest

from soapsearch import zoo
from soapsearch.executor import launch
from soapsearch.executor.model import build_model
from strategies import data_parallel
from strategies.serialize import save_strategy
from tests.conftest import traced


@pytest.mark.parametrize("name,dtype", [(n, "float64") for n in zoo.names()] + [("mlp", None)])
def test_meta_graph_is_the_ranks_graph(name, dtype):
    meta = build_model(name, "tiny", dtype=dtype, device="meta").graph
    cpu = build_model(name, "tiny", dtype=dtype).graph
    assert meta.fingerprint() == cpu.fingerprint()
    assert [n.name for n in meta] == [n.name for n in cpu]


def test_check_plan_builds_no_weights(tmp_path, monkeypatch):
    graph = traced("mlp")
    plan = tmp_path / "dp.json"
    save_strategy(plan, data_parallel(graph, 2), graph)
    devices = []
    real = zoo.build

    def spy(*args, **kwargs):
        devices.append(str(kwargs.get("device")))
        return real(*args, **kwargs)

    monkeypatch.setattr(zoo, "build", spy)
    assert launch.check_plan(plan, "mlp", variant="tiny") == 2
    assert devices == ["meta"]
