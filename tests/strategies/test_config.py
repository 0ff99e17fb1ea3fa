import math

import pytest

from strategies import ParallelConfig, PlanError, enumerate_configs, validate_config
from strategies.config import degree_grids, device_blocks, format_devices
from tests.conftest import traced


def test_parallel_config_checks_devices_against_degrees():
    with pytest.raises(PlanError, match=r"3 devices for prod\(degrees \[2, 2\]\) = 4"):
        ParallelConfig((2, 2), (0, 1, 2))
    with pytest.raises(PlanError, match=r"device\(s\) \[1\] appear twice"):
        ParallelConfig((2,), (1, 1))
    with pytest.raises(PlanError, match=r"degrees\[0\] = 0"):
        ParallelConfig((0,), ())


def test_short_string_form():
    g = traced("mlp")
    node = g["layers_0"]  # dims: sample, out_features
    assert ParallelConfig((4, 2), tuple(range(8))).show(node.dims) == "S4·P2 @ 0-7"
    assert ParallelConfig((1, 1), (3,)).show(node.dims) == "@ 3"
    assert format_devices((0, 1, 2, 3, 8, 9, 10, 11)) == "0-3,8-11"


def test_validate_names_op_dim_and_arithmetic():
    g = traced("mlp")
    node = g["layers_0"]  # [4, 32] from 16 in_features
    with pytest.raises(PlanError, match=r"op 'layers_0': degrees = \[1, 3, 1\]: degree 3 on dim 'out_features'\(32\) does not divide it"):
        validate_config(node, ParallelConfig((1, 3, 1), (0, 1, 2)), 4)
    with pytest.raises(PlanError, match=r"op 'layers_0': degrees = \[1, 1, 3\]: degree 3 on dim 'in_features'\(16\) does not divide it"):
        validate_config(node, ParallelConfig((1, 1, 3), (0, 1, 2)), 4)  # a reduction cut, like any other
    with pytest.raises(PlanError, match=r"devices\[1\] = 4: device 4 is out of range for 4 devices"):
        validate_config(node, ParallelConfig((2, 1, 1), (0, 4)), 4)
    with pytest.raises(PlanError, match=r"degree 4 on dim 'sample'\(4 / 2 micro-batches = 2\)"):
        validate_config(node, ParallelConfig((4, 1, 1), (0, 1, 2, 3)), 4, microbatches=2)
    with pytest.raises(PlanError, match=r"2 degrees for 3 dims \['sample', 'out_features', 'in_features'\]"):
        validate_config(node, ParallelConfig((1, 1), (0,)), 4)


def test_forbidden_dim_is_rejected():
    g = traced("gpt")
    ln = next(n for n in g if n.kind == "layernorm")
    degrees = tuple(2 if i == len(ln.dims) - 1 else 1 for i in range(len(ln.dims)))
    with pytest.raises(PlanError, match=r"may not be split"):
        validate_config(ln, ParallelConfig(degrees, (0, 1)), 2)


def test_enumeration_is_every_valid_config():
    g = traced("mlp")
    node = g["layers_0"]  # [4, 32] from 16: degrees (s, p, r) with s | 4, p | 32, r | 16, s*p*r <= 8
    grids = degree_grids(node, 8)
    want = {(s, p, r) for s in (1, 2, 4) for p in (1, 2, 4, 8, 16, 32) for r in (1, 2, 4, 8, 16)
            if s * p * r <= 8}
    assert set(grids) == want and grids[0] == (1, 1, 1)
    assert ParallelConfig((2, 1, 4), tuple(range(8))).show(node.dims) == "S2·R4 @ 0-7"
    configs = list(enumerate_configs(node, 8))
    for c in configs:
        validate_config(node, c, 8)
    # contiguous blocks aligned to their size: 8/p of them for p partitions
    assert len(configs) == sum(8 // math.prod(gr) for gr in want)
    assert len(set(configs)) == len(configs)


def test_device_blocks_topology_aligned():
    assert device_blocks(2, 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 4 nodes x 2 devices: blocks of 2 spread one per node over 2 consecutive nodes
    spread = device_blocks(2, 8, node_size=2)
    assert (0, 2) in spread and (1, 3) in spread and (4, 6) in spread and (5, 7) in spread
    assert all(len(set(b)) == 2 for b in spread)


@pytest.mark.parametrize("n,m", [(4, 2), (8, 2), (4, 4), (8, 4)])
def test_every_enumerated_config_lowers_with_micro_batches(n, m):
    """A reshape [12, 8, 50] -> [96, 50] (gpt tiny, batch 12) with m micro-batches: degree d on
    the sample dim cuts it into m·d pieces, each of which must fall on whole rows of the input:
    d = 2 with m = 4 would make pieces of 12 rows of 96, i.e. 1.5 input rows, and is not
    enumerated (every enumerated config lowers)."""
    from strategies import Strategy
    from strategies.pieces import lower_op

    g = traced("gpt", batch_size=12)
    configs = {node.name: list(enumerate_configs(node, n, m)) for node in g}
    base = {op: c[0] for op, c in configs.items()}
    for node in g:
        for cfg in configs[node.name]:
            lower_op(g, Strategy.of({**base, node.name: cfg}, n, m), node, m)  # raises on a piece that is not a box
    if m == 4:
        assert all(cfg.degrees[0] != 2 for cfg in configs[_flattening_view(g).name])


def _flattening_view(g):
    """gpt tiny's reshape [12, 8, 50] -> [96, 50] (batch 12)."""
    return next(node for node in g if node.kind == "reshape" and node.input_specs[0].shape[:2] == (12, 8)
                and node.shape[0] == 96)


def test_the_degree_check_names_the_micro_batches():
    view = _flattening_view(traced("gpt", batch_size=12))
    with pytest.raises(PlanError, match=r"with 4 micro-batches, degree 2 on the sample dim cuts it as degree 8"):
        validate_config(view, ParallelConfig((2,) + (1,) * (len(view.dims) - 1), (0, 1)), 2, 4)
    validate_config(view, ParallelConfig((2,) + (1,) * (len(view.dims) - 1), (0, 1)), 2, 1)  # 6 input rows each
