import json
import subprocess
import sys
import textwrap


from soapsearch.cli import main
from strategies import read_plan
from tests.conftest import traced


def test_show_prints_op_table(capsys):
    assert main(["show", "alexnet", "--variant", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("alexnet-tiny: ")
    conv = next(n for n in traced("alexnet") if n.kind == "conv2d")
    row = next(line for line in out.splitlines() if line.startswith(conv.name + " "))
    n, c, h, w = conv.shape
    assert row.split()[1:3] == ["conv2d", f"S{n}×P{c}×A{h}×A{w}"]
    assert f"weight[{','.join(map(str, conv.weights[0].spec.shape))}]" in row


def test_show_json_matches_graph(capsys):
    assert main(["show", "gpt", "--variant", "tiny", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    g = traced("gpt")
    assert obj["fingerprint"] == g.fingerprint() and len(obj["ops"]) == len(g)
    assert obj["batch_size"] == g.batch_size and obj["opaque"] == []
    head = next(o for o in obj["ops"] if o["name"] == "lm_head")
    assert [d["role"] for d in head["dims"]] == ["sample", "attribute", "parameter"]
    assert head["weights"] == {"lm_head.weight": [50, 16]}


def test_plan_writes_loadable_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "resnet101", "--variant", "tiny", "--baseline", "owt", "--devices", "2",
                 "-o", str(out)]) == 0
    loaded = read_plan(out, traced("resnet101"))
    assert loaded.strategy.num_devices == 2
    assert loaded.topology["name"] == "local-cpu-2"
    assert "wrote owt plan" in capsys.readouterr().out


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
            return F.cross_entropy(self.fc(torch.cumsum(x, 1)), y)

    def make(batch_size=4):
        return Net(), (torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,)))
""")
"""A user's model file whose cumsum no rule covers (an opaque op)."""


def test_user_factory_file_and_opaque_warning(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(OPAQUE_NET)
    assert main(["show", f"{src}:make", "--batch-size", "8"]) == 0
    captured = capsys.readouterr()
    assert "batch 8" in captured.out
    assert "warning: 1 opaque op(s)" in captured.err and "cumsum" in captured.err


def test_console_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "soapsearch", "zoo"], capture_output=True, text=True)
    assert proc.returncode == 0 and "resnet101" in proc.stdout and "gpt" in proc.stdout


def test_simulate_json_and_trace(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["simulate", "alexnet", "--variant", "tiny", "--baseline", "owt", "--topology",
                 "p100-1x2", "--trace", str(out), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["iteration_ms"] > 0 and obj["fits"] is True and len(obj["peak_memory_bytes"]) == 2
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
