"""gemma4_mtp_kernels/triton/tuned.py: a tuned-configuration file (benchmarks/tune_launch_configs.py --tuned-out)
is checked entry by entry, its entries reach the launchers at their shapes only and compute what the reference
computes, it is ignored on another device, and the sweep times every launch shape of a B = 1 step, so that the
file it writes applies to the step (bench_drafter_step's `triton_tuned`)."""
import json
import os
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

from benchmarks import tune_launch_configs as tune
from gemma4_mtp_kernels.triton import _common, tuned
from test_bench_dry import ROOT


def _write(tmp_path, entries, device="NVIDIA H200", name="tuned.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"schema": 1, "device": device, "entries": entries}))
    return str(path)


@pytest.fixture
def in_force(monkeypatch):
    """tuned.PATH set for the test, the caches of every file and device read cleared around it."""
    def use(path):
        monkeypatch.setattr(tuned, "PATH", path)
    for f in (tuned.load, tuned._applies, tuned._device_name):
        f.cache_clear()
    yield use
    for f in (tuned.load, tuned._applies):  # (before monkeypatch restores what a test replaced)
        f.cache_clear()


LINEAR = {"op": "rms_norm_linear", "shape": {"T": 1, "N": 1024, "K": 16384}, "config": {"block_k": 128}}


@pytest.mark.parametrize("entries, fault", [
    ([{**LINEAR, "op": "rms_norm"}], "entries[0].op must be one of"),
    ([{**LINEAR, "config": {"block_m": 64}}], "entries[0].config sets ['block_m'], which rms_norm_linear's"),
    ([LINEAR, {**LINEAR, "config": {"num_stages": 0}}], "entries[1].config values must be positive integers"),
    ([{**LINEAR, "config": {"num_stages": "4"}}], "entries[0].config values must be positive integers"),
    ([{**LINEAR, "config": {"block_k": 96, "num_warps": 6, "num_stages": 3}}],
     "entries[0].config ['block_k', 'num_warps'] must be powers of two"),
    ([{**LINEAR, "config": {}}], "entries[0].config must be a non-empty object"),
    ([{**LINEAR, "shape": {"T": 1.0}}], "entries[0].shape must map names to integers"),
    ([{**LINEAR, "shape": []}], "entries[0].shape must map names to integers"),
])
def test_a_faulty_entry_is_named(tmp_path, in_force, entries, fault):
    in_force(_write(tmp_path, entries))
    with pytest.raises(ValueError) as e:
        tuned.overrides("rms_norm_linear", torch.device("cpu"), T=1, N=1024, K=16384)
    assert fault in str(e.value) and tuned.ENV in str(e.value)


@pytest.mark.parametrize("text, fault", [
    (None, "cannot read"), ("{not json", "cannot read"), ('{"schema": 2, "device": "x", "entries": []}', "schema 1"),
    ('[{"op": "rms_norm_linear"}]', "schema 1"), ('{"schema": 1, "entries": []}', "schema 1"),
])
def test_a_file_that_is_not_one_is_named(tmp_path, in_force, text, fault):
    path = tmp_path / "t.json"
    if text is not None:
        path.write_text(text)
    in_force(str(path))
    with pytest.raises(ValueError, match=fault) as e:
        tuned.overrides("rms_norm_linear", torch.device("cpu"), T=1, N=1024, K=16384)
    assert str(path) in str(e.value)


def test_no_file_no_overrides(in_force):
    in_force(None)
    assert tuned.overrides("rms_norm_linear", torch.device("cuda", 0), T=1, N=1024, K=16384) == {}


def test_a_file_of_another_device_is_ignored_with_a_warning(tmp_path, in_force, monkeypatch):
    in_force(_write(tmp_path, [LINEAR]))
    shape = LINEAR["shape"]
    monkeypatch.setattr(tuned, "_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    with pytest.warns(UserWarning, match="measured on NVIDIA H200, not on this NVIDIA A100-SXM4-80GB"):
        assert tuned.overrides("rms_norm_linear", torch.device("cuda", 0), **shape) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file and device
        assert tuned.overrides("rms_norm_linear", torch.device("cuda", 0), **shape) == {}
    monkeypatch.setattr(tuned, "_device_name", lambda index: "NVIDIA H200")
    assert tuned.overrides("rms_norm_linear", torch.device("cuda", 1), **shape) == {"block_k": 128}
    # other shapes and ops keep the launcher's choice
    assert tuned.overrides("rms_norm_linear", torch.device("cuda", 1), **{**shape, "T": 2}) == {}
    assert tuned.overrides("rms_norm_gate_up", torch.device("cuda", 1), **shape) == {}


def _dry_case(key):
    """The sweep's first dry case of a tuned file's op `key` (tiny shapes)."""
    return next(c for c in tune.cases(True) if tune.config_key(c.op, c.params) == key)


def check_entry_reaches_its_launch(tmp_path, in_force, key, device, dtype, device_name):
    """A launch through the public op (the sweep's dry case) with a file whose entry names its shape gets the
    entry's keywords (the case's first variant), and computes what the reference computes; the same file
    with the entry at another shape, or measured on another device, leaves the launcher's choice."""
    case = _dry_case(key)
    inputs = case.make_inputs(device, dtype, 0)
    expected = case.reference(inputs)
    spy = case.baselines["triton"]  # the sweep's factory of the launcher's own choice: it records what it got
    in_force(None)
    plain = spy(inputs)
    plain()
    default, shape = plain.provenance["launch_config"], plain.provenance["shape"]
    assert shape, case.label
    kw = tune.variants(case.op, case.params, _common.num_sms(device), dtype.itemsize)[0]

    in_force(_write(tmp_path, [{"op": key, "shape": shape, "config": kw}], device=device_name))
    run = spy(inputs)
    got = run()
    cfg = run.provenance["launch_config"]
    for k, v in kw.items():
        name = {"block_k": "BLOCK_K", "block_n": "BLOCK_N", "block_i": "BLOCK_I", "min_tiles": "MIN_TILES"}.get(k, k)
        assert cfg[name] == v != default[name], (case.label, k, cfg)
    assert case.default_compare(got, expected)["ok"], case.label

    elsewhere = {**shape, "T" if "T" in shape else "B": 99}
    others = [({"shape": elsewhere}, device_name)]
    if device.type == "cuda":  # the interpreter has no device name: a file applies there whatever it names
        others.append(({}, "another GPU"))
    for i, (where, name) in enumerate(others):
        in_force(_write(tmp_path, [{"op": key, "shape": shape, "config": kw, **where}], device=name,
                        name=f"other{i}.json"))
        other = spy(inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the other device's warning: tested above)
            other()
        assert other.provenance["launch_config"] == default, (case.label, where, name)


@pytest.mark.parametrize("key", tuned.CONFIG_FUNCTIONS)
def test_an_entry_reaches_its_launch_at_its_shape_and_computes_the_op(tmp_path, in_force, key):
    check_entry_reaches_its_launch(tmp_path, in_force, key, torch.device("cpu"), torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("key", tuned.CONFIG_FUNCTIONS)
def test_an_entry_reaches_its_compiled_launch_on_a_gpu(tmp_path, in_force, key):
    check_entry_reaches_its_launch(tmp_path, in_force, key, torch.device("cuda"), torch.bfloat16,
                                   torch.cuda.get_device_name())


def _result(name, us, shape, kw, ok=True):
    return {"baseline": name, "status": "ok", "time_s": us * 1e-6, "check": {"ok": ok},
            "provenance": {"keywords": kw, "shape": shape, "launch_config": {}}}


def test_the_sweep_writes_its_clear_winners_as_a_file_the_launchers_read(tmp_path, in_force):
    o_proj = {"T": 1, "N": 1024, "K": 16384}
    q_proj = {"T": 1, "N": 16384, "K": 1024, "D": 512}
    attn = {"B": 1, "Q": 1, "Hq": 4, "Hkv": 1, "D": 512, "keys": 8192, "bytes": 2}
    results = {"env": {"commit": "abc"}, "cases": [
        {"op": "rms_norm_linear", "case": "31B o_proj full T=1", "floor_s": 8e-6, "results": [
            _result("triton", 16.0, o_proj, {}), _result("triton block_k=128", 9.0, o_proj, {"block_k": 128}, ok=False),
            _result("triton block_k=128 num_stages=4", 12.0, o_proj, {"block_k": 128, "num_stages": 4})]},
        {"op": "rms_norm_linear", "case": "31B down_proj T=1 (same shape)", "floor_s": 8e-6, "results": [
            _result("triton", 16.0, o_proj, {}), _result("triton split_k=1", 14.0, o_proj, {"split_k": 1})]},
        {"op": "rms_norm_q_rope", "case": "within noise", "floor_s": None, "results": [
            _result("triton", 10.0, q_proj, {}), _result("triton num_stages=4", 9.6, q_proj, {"num_stages": 4})]},
        {"op": "q_only_paged_attention", "case": "E2B full", "floor_s": None, "results": [
            _result("triton", 23.0, attn, {}), _result("triton min_tiles=4", 19.0, attn, {"min_tiles": 4})]},
        {"op": "rms_norm_gate_up", "case": "the launcher's choice wins", "floor_s": None, "results": [
            _result("triton", 10.0, o_proj, {}), _result("triton num_stages=4", 11.0, o_proj, {"num_stages": 4})]},
    ]}
    for c in results["cases"]:  # the key of each case's configuration (none here is the one-launch MLP)
        for r in c["results"]:
            r["provenance"]["op"] = c["op"]
    got = tune.tuned_file(results, "NVIDIA H200")
    assert got["device"] == "NVIDIA H200" and got["env"] == {"commit": "abc"}
    assert [(e["op"], e["config"], e["gain"]) for e in got["entries"]] == [
        ("rms_norm_linear", {"block_k": 128, "num_stages": 4}, round(16 / 12, 3)),
        ("q_only_paged_attention", {"min_tiles": 4}, round(23 / 19, 3))]
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(got))
    in_force(str(path))
    assert tuned.overrides("rms_norm_linear", torch.device("cpu"), **o_proj) == {"block_k": 128, "num_stages": 4}
    assert tuned.overrides("q_only_paged_attention", torch.device("cpu"), **attn) == {"min_tiles": 4}
    assert tuned.overrides("rms_norm_q_rope", torch.device("cpu"), **q_proj) == {}


# A B = 1, 8K step of each drafter as launch_count records it (meta tensors, the real @triton.jit kernels, no
# interpreter), printing the shape each launcher looked up.
STEP_LOOKUPS = """
import json, sys
from benchmarks.launch_count import count_step
from gemma4_mtp_kernels.triton import tuned
seen, original = [], tuned.overrides
tuned.overrides = lambda op, device, **shape: seen.append([op, shape]) or original(op, device, **shape)
out = {}
for name in sys.argv[1:]:
    seen.clear()
    count_step(name)
    out[name] = list(seen)
print(json.dumps(out))
"""


def test_the_sweep_times_every_launch_shape_of_a_b1_step():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python_api")]))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", STEP_LOOKUPS, "E2B", "31B"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = json.loads(p.stdout)

    def looked_up(c):  # the shape a case's launcher looks up, from the benchmark's own parameters
        q = c.params
        if c.op == "q_only_paged_attention":
            keys = -(-q["ctx"] // q["block_size"]) * q["block_size"]
            keys = keys if q["window"] is None else min(keys, q["window"])
            return c.op, dict(B=q["B"], Q=q["Q"], Hq=q["Hq"], Hkv=q["Hkv"], D=q["D"], keys=keys, bytes=2)
        if c.op == "fused_concat_down_proj":
            return c.op, dict(T=q["T"], N=q["Hd"], K=2 * q["Hb"])
        if "down" in q:  # the one-launch MLP: down_proj's rows, gate_up's
            return tune.MLP, dict(T=q["T"], N=q["down"], K=q["H"], I=q["N"])
        return c.op, dict(T=q["T"], N=q["N"], K=q["H"], **({"D": q["D"]} if c.op == "rms_norm_q_rope" else {}))

    with mock.patch.object(_common, "num_sms", lambda device: 132):
        swept = [looked_up(c) for c in tune.cases(False)]
    for name, lookups in steps.items():
        assert len(lookups) >= 8, (name, lookups)
        missing = [lk for lk in map(tuple, lookups) if lk not in swept]
        assert not missing, (name, missing)
    assert len(swept) == len({json.dumps(s, sort_keys=True) for s in swept})  # one case a shape


def test_the_step_benchmark_times_the_step_with_the_sweeps_file(tmp_path, in_force, monkeypatch):
    """bench_drafter_step's `triton_tuned` (what gpu_check.sh times after its sweep): the step with the file's
    entries in force, computing what the reference backend computes; no such baseline without a file or with
    one that has no entries (it would time `triton` again)."""
    from benchmarks import bench_drafter_step as bds
    in_force(None)
    monkeypatch.delenv(bds.TUNED_ENV, raising=False)

    def step():  # the dry run's B = 1 step (its variants' cases)
        return next(c for c in bds.cases(True) if c.op == "drafter_step" and c.params["B"] == 1)
    case = step()
    assert "triton_tuned" not in case.baselines
    inputs = case.make_inputs(torch.device("cpu"), torch.float32, 0)
    expected = case.reference(inputs)

    def lookups(run):
        seen, original = [], tuned.overrides

        def spy(op, device, **shape):
            got = original(op, device, **shape)
            seen.append((op, shape, got))
            return got
        with mock.patch.object(tuned, "overrides", spy):
            out = run()
        return seen, out
    seen, _ = lookups(case.baselines["triton"](inputs))
    gemvs = {json.dumps([op, shape], sort_keys=True) for op, shape, _ in seen if op != "q_only_paged_attention"}
    assert len(gemvs) >= 3 and all(got == {} for *_, got in seen)
    entries = [{"op": op, "shape": shape, "config": {"num_stages": 2}} for op, shape in map(json.loads, gemvs)]

    monkeypatch.setenv(bds.TUNED_ENV, _write(tmp_path, []))
    assert "triton_tuned" not in step().baselines
    monkeypatch.setenv(bds.TUNED_ENV, _write(tmp_path, entries, name="winners.json"))
    case = step()
    seen, got = lookups(case.baselines["triton_tuned"](inputs))
    assert [g for op, _, g in seen if op != "q_only_paged_attention"] == \
        [{"num_stages": 2}] * sum(op != "q_only_paged_attention" for op, *_ in seen)
    assert case.default_compare(got, expected)["ok"]
    assert tuned.PATH is None  # only while the baseline runs
