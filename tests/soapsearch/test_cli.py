import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from soapsearch import DEFAULT_TOPOLOGY, zoo
from soapsearch.cli import main
from strategies import read_plan
from tests.conftest import cli_error, traced


def test_show_prints_op_table(capsys):
    assert main(["show", "alexnet", "--variant", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("alexnet-tiny: ")
    conv = next(n for n in traced("alexnet") if n.kind == "conv2d")
    row = next(line for line in out.splitlines() if line.startswith(conv.name + " "))
    n, c, h, w, i = conv.shape
    assert row.split()[1:3] == ["conv2d", f"S{n}×P{c}×A{h}×A{w}×R{i}"]  # R: its in channels
    assert f"weight[{','.join(map(str, conv.weights[0].spec.shape))}]" in row


def test_show_json_matches_graph(capsys):
    assert main(["show", "gpt", "--variant", "tiny", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    g = traced("gpt")
    assert obj["fingerprint"] == g.fingerprint() and len(obj["ops"]) == len(g)
    assert obj["batch_size"] == g.batch_size and obj["opaque"] == []
    head = next(o for o in obj["ops"] if o["name"] == "lm_head")
    assert [d["role"] for d in head["dims"]] == ["sample", "attribute", "parameter", "reduction"]
    assert head["weights"] == {"lm_head.weight": [50, 16]}


def test_plan_writes_loadable_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "resnet101", "--variant", "tiny", "--baseline", "owt", "--devices", "2",
                 "-o", str(out)]) == 0
    loaded = read_plan(out, traced("resnet101"))
    assert loaded.strategy.num_devices == 2
    assert loaded.topology["name"] == DEFAULT_TOPOLOGY
    assert f"wrote owt plan for resnet101-tiny on 2 devices of {DEFAULT_TOPOLOGY}" in capsys.readouterr().out
    assert main(["plan", "resnet101", "--variant", "tiny", "--baseline", "owt", "--topology", "local-cpu-2",
                 "-o", str(out)]) == 0  # every device of the topology
    assert read_plan(out, traced("resnet101")).strategy.num_devices == 2
    assert "(replacing its plan for the same model)" in capsys.readouterr().out
    assert ("plan --devices = 32: more than the 16 devices of 'p100-4x4'; give a --topology"
            in cli_error(capsys, ["plan", "mlp", "--variant", "tiny", "--baseline", "owt", "--devices", "32",
                                  "-o", str(out)]))


def _subcommands():
    from soapsearch.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_command_defaults_to_one_topology():
    """plan, simulate and search (and the Python API) default to DEFAULT_TOPOLOGY and say so."""
    import inspect

    import soapsearch
    from soapsearch.search.study import study_search

    defaults = {}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if action.dest == "topology" and not action.required:
                defaults[name] = action.default
                assert f"default {DEFAULT_TOPOLOGY}" in action.help, name
    assert defaults == {"plan": DEFAULT_TOPOLOGY, "simulate": DEFAULT_TOPOLOGY, "search": DEFAULT_TOPOLOGY}
    for fn in (soapsearch.simulate, soapsearch.search, study_search):
        assert inspect.signature(fn).parameters["topology"].default == DEFAULT_TOPOLOGY, fn


def test_every_variant_help_names_every_variant():
    helps = [(name, a.help) for name, p in _subcommands().items() for a in p._actions if a.dest == "variant"]
    assert {name for name, _ in helps} >= {"show", "plan", "simulate", "search", "calibrate", "compare"}
    for name, text in helps:  # a help that lists variants lists them all
        named = [v for v in zoo.VARIANTS if v in (text or "")]
        assert named in ([], list(zoo.VARIANTS)), (name, text)


def test_bad_inputs_are_one_line_errors(capsys, tmp_path):
    assert main(["show", "nosuchnet"]) == 2
    assert "model 'nosuchnet' is not a zoo model" in capsys.readouterr().err
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "data_parallel",
                 "--devices", "3", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "batch 4 is not divisible by 3 devices" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


OPAQUE_NET = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)
        def forward(self, x, y):
            return F.cross_entropy(self.fc(torch.flip(x, [1])), y)

    def make(batch_size=4):
        return Net(), (torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)))
""")
"""A user's model file whose flip no rule covers (an opaque op)."""


def test_user_factory_file_and_opaque_warning(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(OPAQUE_NET)
    assert main(["show", f"{src}:make", "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    assert "batch 8" in captured.out
    assert "warning: 1 opaque op(s)" in captured.err and "flip" in captured.err


LOGITS_NET = textwrap.dedent("""
    import torch, torch.nn as nn

    def make(batch_size=4):
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), (torch.randn(batch_size, 6),)
""")
"""A user's model that returns logits, not a loss."""


def test_a_model_without_a_scalar_loss_is_refused_up_front(tmp_path, capsys):
    from soapsearch.executor import ExecutorError, build_model, check_runnable
    from strategies import data_parallel
    from strategies.lowering import lower

    src = tmp_path / "logits.py"
    src.write_text(LOGITS_NET)
    graph = build_model(f"{src}:make").graph
    with pytest.raises(ExecutorError) as refused:
        check_runnable(lower(graph, data_parallel(graph, 1)), 1)
    run_says = str(refused.value)
    assert run_says.startswith("the model must return one scalar loss; its outputs are ['_2'] with shapes [[4, 3]]")
    out = tmp_path / "plan.json"
    for argv in (["show", f"{src}:make"],
                 ["search", f"{src}:make", "--topology", "p100-1x2", "--proposals", "5", "-o", str(out)],
                 ["plan", f"{src}:make", "--baseline", "data_parallel", "--devices", "2", "-o", str(out)],
                 ["simulate", f"{src}:make", "--baseline", "data_parallel", "--topology", "p100-1x2"]):
        assert cli_error(capsys, argv) == f"soapsearch {argv[0]}: error: {run_says}\n"
    assert not out.exists()


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "soapsearch", "zoo"], capture_output=True, text=True)
    assert proc.returncode == 0 and "resnet101" in proc.stdout and "gpt" in proc.stdout


def test_simulate_json_and_trace(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["simulate", "alexnet", "--variant", "tiny", "--baseline", "owt", "--topology",
                 "p100-1x2", "--trace", str(out), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["iteration_ms"] > 0 and obj["fits"] is True and len(obj["peak_memory_bytes"]) == 2
    peak = obj["peak_memory"]  # the busiest device's peak and its breakdown, bytes
    assert peak["bytes"] == max(obj["peak_memory_bytes"]) == obj["peak_memory_bytes"][peak["device"]]
    assert set(peak["breakdown"]) == {"weights", "gradients", "optimizer_state", "activations",
                                      "receive_buffers", "collective_buffers", "master_weights", "gathered_weights",
                                      "gradient_buckets"}
    assert sum(peak["breakdown"].values()) == peak["bytes"] and peak["breakdown"]["activations"] > 0
    from strategies import owt
    from strategies.lowering import lower

    lowered = lower(traced("alexnet"), owt(traced("alexnet"), 2))
    allreduced = sum(s.nbytes for s in lowered.weight_shards if len(s.devices) > 1 and s.trainable)
    reduced = sum(g.nbytes for g in lowered.reductions)  # the split loss's sum, in the bucket
    # activations forward, their gradients backward, the replicated conv weights' gradients
    # and the loss's [s_p, c_p] riding their all-reduce (strategies.lowering.bucket_sums)
    assert obj["bytes_moved"] == {"nvlink": 2 * 20560 + allreduced + reduced}
    events = json.loads(out.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_simulate_a_plan_file_matches_the_api(tmp_path, capsys):
    import soapsearch

    plan = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--variant", "tiny", "--baseline", "model_parallel", "--devices",
                 "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "mlp", "--variant", "tiny", "--plan", str(plan), "--topology",
                 "local-cpu-2", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    want = soapsearch.simulate(traced("mlp"), str(plan), topology="local-cpu-2")
    assert obj["iteration_ms"] == want.iteration_ms


def test_simulate_needs_exactly_one_plan(capsys):
    assert main(["simulate", "mlp", "--variant", "tiny", "--topology", "local-cpu-2"]) == 2
    assert "exactly one of --plan" in capsys.readouterr().err


def test_topology_show(capsys, tmp_path):
    assert main(["topology", "show", "p100-4x4"]) == 0
    out = capsys.readouterr().out
    assert "16 devices in 4 nodes x 4" in out and "P100" in out and "ib" in out
    assert main(["topology", "show", "p100-1x2", "--json"]) == 0
    path = tmp_path / "t.json"
    path.write_text(capsys.readouterr().out)
    assert main(["topology", "show", str(path)]) == 0
    assert main(["topology", "show", "tpu-9000"]) == 2
    assert "tpu-9000" in capsys.readouterr().err
