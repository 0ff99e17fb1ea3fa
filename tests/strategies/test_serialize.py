import copy
import json

import pytest

from strategies import PlanError, baseline, load_strategy, read_plan, save_strategy, strategy_to_json
from tests.conftest import traced


@pytest.fixture(scope="module")
def mlp():
    return traced("mlp")


@pytest.mark.parametrize("name", ["data_parallel", "model_parallel", "owt", "pipeline"])
def test_round_trip_is_lossless(tmp_path, name):
    g = traced("alexnet")
    plan = baseline(name, g, 4, microbatches=2)
    path = tmp_path / "plan.json"
    save_strategy(path, plan, g, topology="p100-4x4", predicted={"iteration_ms": 1.5})
    loaded = read_plan(path, g)
    assert loaded.strategy == plan
    assert loaded.predicted == {"iteration_ms": 1.5}
    assert loaded.topology == {"name": "p100-4x4", "num_devices": 4}
    assert loaded.model["fingerprint"] == g.fingerprint()
    obj = json.loads(path.read_text())
    assert obj["format"] == "soapsearch.strategy" and obj["version"] == 6
    assert [o["name"] for o in obj["ops"]] == [n.name for n in g]
    # same bytes when written again
    save_strategy(tmp_path / "again.json", loaded.strategy, g, topology="p100-4x4",
                  predicted={"iteration_ms": 1.5})
    assert (tmp_path / "again.json").read_text() == path.read_text()


def _plan(mlp):
    return strategy_to_json(baseline("data_parallel", mlp, 2), mlp, topology="local-cpu-2")


def _op(obj, name):
    return next(o for o in obj["ops"] if o["name"] == name)


def _mutations():
    def version(o): o["version"] = 7
    def overlap(o): o["overlap_grad_reduce"] = "no"
    def cap(o): o["bucket_cap_mb"] = 0
    def cap_type(o): o["bucket_cap_mb"] = "25"
    def unit(o): o["fsdp_unit"] = "layer"
    def zero(o): _op(o, "layers_0")["zero"] = 4
    def zero_type(o): _op(o, "layers_0")["zero"] = "3"
    def zero_no_weight(o): _op(o, "layers_1")["zero"] = 1
    def recompute_type(o): _op(o, "layers_0")["recompute"] = 1
    def recompute_input(o): _op(o, "inputs")["recompute"] = True
    def fingerprint(o): o["model"]["fingerprint"] = "0" * 16
    def not_dividing(o): _op(o, "layers_0").update(degrees=[1, 3, 1], devices=[0, 1, 2])
    def out_of_range(o): _op(o, "layers_0").update(degrees=[1, 2, 1], devices=[0, 7])
    def wrong_count(o): _op(o, "layers_0").update(degrees=[2, 1, 1], devices=[0])
    def missing(o): o["ops"] = [x for x in o["ops"] if x["name"] != "layers_2"]
    def extra(o): o["ops"].append({"name": "ghost", "degrees": [1], "devices": [0]})
    def bad_kind(o): _op(o, "layers_0")["kind"] = "conv2d"
    def bad_type(o): _op(o, "layers_0")["degrees"] = "2,1"
    def duplicate(o): o["ops"].append(copy.deepcopy(_op(o, "layers_0")))
    def microbatches(o): o["microbatches"] = 3
    def schedule(o): o["schedule"] = "zigzag"
    return [
        (version, r"version = 7: this soapsearch reads versions 1, 2, 3, 4, 5, 6"),
        (overlap, r"overlap_grad_reduce = 'no': must be true or false"),
        (cap, r"bucket_cap_mb = 0: the gradient bucket cap in MiB must be a finite number > 0"),
        (cap_type, r"bucket_cap_mb = '25': the gradient bucket cap in MiB must be a finite number > 0"),
        (unit, r"fsdp_unit = 'layer': must be one of \['op', 'block'\] \(the ZeRO-3 prefetch unit"),
        (zero, r"op 'layers_0': zero = 4: a sharding level is one of \[0, 1, 2, 3\]"),
        (zero_type, r"op 'layers_0': zero = '3': must be a JSON integer"),
        (zero_no_weight, r"zero = 1: a '\w+' op has no trainable weight to shard"),
        (recompute_type, r"op 'layers_0': recompute = 1: must be a JSON boolean"),
        (recompute_input, r"op 'inputs': recompute = True: an input op computes nothing to recompute"),
        (fingerprint, r"model.fingerprint = '0000000000000000': the plan was made for another model"),
        (not_dividing, r"op 'layers_0': degrees = \[1, 3, 1\]: degree 3 on dim 'out_features'\(32\) does not divide it"),
        (out_of_range, r"op 'layers_0': devices\[1\] = 7: device 7 is out of range for 2 devices"),
        (wrong_count, r"op 'layers_0': devices = \[0\]: 1 devices for prod\(degrees \[2, 1, 1\]\) = 2"),
        (missing, r"op 'layers_2': ops = \['layers_2'\]: 1 op\(s\) of the model have no config"),
        (extra, r"op 'ghost': name = 'ghost': the model has no op of this name"),
        (bad_kind, r"op 'layers_0': kind = 'conv2d': the model's op has kind 'linear'"),
        (bad_type, r"op 'layers_0': degrees = '2,1': must be a JSON array"),
        (duplicate, r"op 'layers_0': name = 'layers_0': the op appears twice"),
        (microbatches, r"3 micro-batches do not divide dim 'sample'\(4\)"),
        (schedule, r"schedule = 'zigzag': must be one of"),
    ]


@pytest.mark.parametrize("mutate,message", _mutations(), ids=lambda x: getattr(x, "__name__", ""))
def test_bad_plans_name_op_field_value(tmp_path, mlp, mutate, message):
    obj = _plan(mlp)
    mutate(obj)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(PlanError, match=message) as err:
        load_strategy(path, mlp)
    assert str(path) in str(err.value)


def test_memory_fields_round_trip_and_old_plans_load_as_replicate_keep(tmp_path, mlp):
    plan = baseline("data_parallel", mlp, 2)
    plan = plan.replace("layers_0", plan["layers_0"].with_memory(zero=3, recompute=True))
    obj = strategy_to_json(plan, mlp)
    assert _op(obj, "layers_0")["zero"] == 3 and _op(obj, "layers_0")["recompute"] is True
    assert _op(obj, "layers_2")["zero"] == 0 and _op(obj, "layers_2")["recompute"] is False
    assert load_strategy(obj, mlp) == plan
    assert "zero3 recompute" in plan["layers_0"].show()
    for version in (1, 2):
        old = copy.deepcopy(obj)
        old["version"] = version
        for op in old["ops"]:
            del op["zero"], op["recompute"]
        loaded = load_strategy(old, mlp)
        assert all(c.zero == 0 and not c.recompute for _, c in loaded.items())


def test_bucket_cap_round_trips_and_older_plans_load_with_ddps_25_mib(mlp):
    plan = baseline("data_parallel", mlp, 2).with_bucket_cap(0.5)
    obj = strategy_to_json(plan, mlp)
    assert obj["bucket_cap_mb"] == 0.5 and load_strategy(obj, mlp) == plan
    assert plan.bucket_cap_bytes == 524288
    old = copy.deepcopy(obj)
    old["version"] = 3
    del old["bucket_cap_mb"], old["fsdp_unit"]
    assert load_strategy(old, mlp).bucket_cap_mb == 25.0 and load_strategy(old, mlp).fsdp_unit == "op"
    assert load_strategy(old, mlp).bucket_cap_bytes == 26214400


def test_overlap_grad_reduce_round_trips_and_older_plans_overlap(mlp):
    plan = baseline("data_parallel", mlp, 2).with_overlap_grad_reduce(False)
    obj = strategy_to_json(plan, mlp)
    assert obj["overlap_grad_reduce"] is False and load_strategy(obj, mlp) == plan
    assert plan != plan.with_overlap_grad_reduce(True)
    old = copy.deepcopy(obj)
    old["version"] = 5
    del old["overlap_grad_reduce"]
    assert load_strategy(old, mlp).overlap_grad_reduce is True


def test_a_plan_for_another_shape_names_the_first_op_that_differs(mlp):
    # each op records its output shape and dtype, so the refusal says where the models part
    small = traced("mlp", batch_size=2)
    with pytest.raises(PlanError, match=r"made for another model, variant or batch size: mlp \(batch 4\), the model "
                                        r"given is mlp \(batch 2, fingerprint '[0-9a-f]+'\); first difference: op 0 "
                                        r"\('inputs'\) has shape \[4, 16\] in the plan, \[2, 16\] in the model"):
        load_strategy(_plan(mlp), small)
    # a plan without the shapes loads, and its refusal compares what it records
    old = _plan(mlp)
    for op in old["ops"]:
        del op["shape"], op["dtype"]
    assert load_strategy(old, mlp) == baseline("data_parallel", mlp, 2)
    with pytest.raises(PlanError, match=r"the plan records no output shapes"):
        load_strategy(old, small)


def test_split_on_forbidden_dim(tmp_path):
    g = traced("gpt")
    obj = strategy_to_json(baseline("data_parallel", g, 2), g)
    ln = next(n for n in g if n.kind == "layernorm")
    degrees = [1] * len(ln.dims)
    degrees[-1] = 2
    _op(obj, ln.name).update(degrees=degrees, devices=[0, 1])
    with pytest.raises(PlanError, match=rf"op '{ln.name}': degrees = .*dim 'd2' of a 'layernorm' op may not be split|op '{ln.name}'.*may not be split"):
        load_strategy(obj, g)


def test_malformed_json(tmp_path, mlp):
    path = tmp_path / "broken.json"
    path.write_text('{"format": "soapsearch.strategy", "version": 1,')
    with pytest.raises(PlanError, match=r"json = 'line 1 column \d+': not valid JSON"):
        load_strategy(path, mlp)
    with pytest.raises(PlanError, match=r"format = None: must be 'soapsearch.strategy'"):
        load_strategy({"version": 1}, mlp)


def test_save_is_atomic_and_validates(tmp_path, mlp):
    path = tmp_path / "plan.json"
    good = baseline("data_parallel", mlp, 2)
    save_strategy(path, good, mlp)
    before = path.read_text()
    bad = good.replace("layers_0", type(good["layers_0"])((1, 2, 1), (0, 5)))
    with pytest.raises(PlanError, match="out of range"):
        save_strategy(path, bad, mlp)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
