"""The scan rule (cumsum, cumprod along one dim) and the gather rule against real arithmetic:
every partition of random degree grids computed from only the region it reads; the scanned dim
is never cut."""

import torch
import torch.nn as nn

from soapsearch.trace import trace
from strategies.rules import get_rule
from tests.strategies.rulecheck import check_model


class Scans(nn.Module):
    def forward(self, x, mask):
        positions = torch.cumsum(mask, dim=1) * mask - 1  # OPT's position ids
        return x.cumsum(-1) + torch.cumprod(x, 1, dtype=torch.float64), positions


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(4, 6, 8), torch.ones(4, 6, dtype=torch.int64)]


def test_scans_are_ops_whose_scanned_dim_is_whole():
    graph = trace(Scans(), _inputs())
    scans = [n for n in graph if n.kind == "scan"]
    assert [(n.attrs["fn"], n.attrs["dim"], n.attrs["dtype"]) for n in scans] == [
        ("cumsum", 1, None), ("cumsum", 2, None), ("cumprod", 1, "float64")]
    assert [get_rule("scan").splittable(n) for n in scans] == [
        (True, False), (True, True, False), (True, False, True)]


def test_scans_against_real_arithmetic():
    assert check_model(Scans(), _inputs(), kinds={"scan"}, count=12) >= 15


def test_export_records_the_same_scan():
    fx_ops = [dict(n.attrs) for n in trace(Scans(), _inputs(), capture="fx") if n.kind == "scan"]
    ex_ops = [dict(n.attrs) for n in trace(Scans(), _inputs(), capture="export") if n.kind == "scan"]
    assert fx_ops == ex_ops


class Gathers(nn.Module):
    """torch.gather along each dim, an index smaller than x on the other dims (BERT gathers its
    token-type ids by position)."""

    def forward(self, x, i0, i1):
        return torch.gather(x, 1, i1), x.gather(0, i0) * 2


def test_gather_against_real_arithmetic():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    i1 = torch.randint(0, 6, (4, 3, 8))
    i0 = torch.randint(0, 4, (2, 6, 4))
    graph = trace(Gathers(), [x, i0, i1])
    assert [n.attrs["dim"] for n in graph if n.kind == "gather"] == [1, 0]
    assert check_model(Gathers(), [x, i0, i1], kinds={"gather"}, count=12) >= 15
