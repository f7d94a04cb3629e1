"""benchmarks/tune_launch_configs.py on CPU: every variant of every case runs through the public op, computes
what the reference computes, and launches with the configuration it names; on real shapes the variants
are the ones the sweep is for; the best variant is picked among the checked ones only."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import tune_launch_configs as tune
from gemma4_mtp_kernels.triton import tuned
from test_bench_dry import ROOT, _env

# keyword of a launcher's config function -> the key of the configuration it sets
KEYS = {"block_n": "BLOCK_N", "block_k": "BLOCK_K", "split_k": "split_k", "num_warps": "num_warps",
        "num_stages": "num_stages", "min_tiles": "MIN_TILES", "block_i": "BLOCK_I"}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "tune.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.tune_launch_configs", "--dry-run", "--out", str(out)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_variant_computes_the_op_with_the_configuration_it_names(dry):
    assert {c["op"] for c in dry["cases"]} == set(tune.OPS)
    # every configuration a tuned file may set is swept (the one-launch MLP's among them)
    assert {c["results"][0]["provenance"]["op"] for c in dry["cases"]} == set(tuned.CONFIG_FUNCTIONS)
    for c in dry["cases"]:
        names = [r["baseline"] for r in c["results"]]
        assert names[0] == "triton" and len(names) == len(set(names)) and len(names) >= 8, (c["case"], names)
        default = c["results"][0]["provenance"]["launch_config"]
        shape = c["results"][0]["provenance"]["shape"]
        for r in c["results"]:
            assert r["status"] == "ok" and r["check"]["ok"], (c["case"], r)
            got = r["provenance"]["launch_config"]
            named = {k: int(v) for k, v in (kv.split("=") for kv in r["baseline"].split()[1:])}
            assert r["provenance"]["keywords"] == named
            for k, v in named.items():
                assert got[KEYS[k]] == v != default[KEYS[k]], (c["case"], r["baseline"], got)
            # the key a tuned file's entry for this variant takes: the same for every variant of a case
            assert r["provenance"]["shape"] == shape and shape, (c["case"], r["provenance"])


def test_the_real_shapes_get_deeper_pipelines_valid_tiles_and_split_choices():
    # 31B o_proj at T = 1 on an H200: the launcher splits K 16 ways (tests/test_fused_glue_triton.py)
    v = tune.variants("rms_norm_linear", dict(T=1, H=16384, N=1024), 132, 2)
    assert {kw.get("split_k") for kw in v} >= {1, 8, 32}
    assert dict(block_k=128, num_stages=4) in v
    # q_rope slices must divide the head: E2B's sliding heads (D 256) take 16..256 (a whole head), its
    # default 32 excluded
    v = tune.variants("rms_norm_q_rope", dict(T=1, H=256, N=1024, D=256), 132, 2)
    assert sorted(kw["block_n"] for kw in v if "block_n" in kw) == [16, 64, 128, 256]
    # attention: fewer, longer key splits and the tiles / pipeline depths around the D 512 default
    v = tune.variants("q_only_paged_attention", dict(D=512, Q=1, Hq=4, Hkv=1), 132, 2)
    assert [kw for kw in v if "min_tiles" in kw] == [dict(min_tiles=m) for m in (1, 4, 8)]
    assert dict(block_n=64) in v and dict(block_n=32) not in v


def test_best_is_the_fastest_checked_variant():
    def r(name, us, ok=True):
        return {"baseline": name, "status": "ok", "time_s": us * 1e-6, "check": {"ok": ok}}
    results = {"cases": [{"op": "rms_norm_linear", "case": "31B o_proj full T=1", "floor_s": 8e-6,
                          "results": [r("triton", 16.0), r("triton block_k=128", 9.0, ok=False),
                                      r("triton num_stages=4", 12.0), r("triton split_k=1", 20.0)]},
                         {"op": "rms_norm_linear", "case": "unchecked default", "floor_s": None,
                          "results": [r("triton", 5.0, ok=False), r("triton num_stages=4", 4.0)]}]}
    (row,) = tune.best(results)
    assert row["best"] == "triton num_stages=4" and row["gain"] == pytest.approx(16 / 12)


def test_refuses_without_a_gpu(tmp_path):
    env = _env()
    env.pop("TRITON_INTERPRET")
    p = subprocess.run([sys.executable, "-m", "benchmarks.tune_launch_configs", "--out", str(tmp_path / "t.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no GPU" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(tmp_path / "t.json")


@pytest.fixture
def spawnable(monkeypatch):
    """A spawned worker process imports the benchmarks and the tests' modules as this process does."""
    path = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))


def test_precompile_workers_run_every_variant(spawnable):
    """The worker pool that compiles the variants before they are timed on a GPU (run_all.precompile:
    spawned processes, a baseline each), here on the dry cases under the interpreter: every variant runs,
    none fails; a deadline already past stops it at once, and cases already done are left out."""
    from benchmarks import run_all
    cases = tune.cases(True)
    n = sum(len(c.baselines) for c in cases)
    done = {(cases[0].op, cases[0].label)}
    got = run_all.precompile(["tune_launch_configs"], 2, float("inf"), dry=True, done=done)
    assert got == {"cases": len(cases) - 1, "cases_run": len(cases) - 1, "baselines_run": n - len(cases[0].baselines),
                   "baselines_failed": 0}
    assert run_all.precompile(["tune_launch_configs"], 2, 0.0, dry=True)["cases_run"] == 0


def test_run_precompiles_before_it_times(tmp_path, spawnable):
    """run_all.run with precompile_jobs: the pool's counts land in the results, then every case runs."""
    from benchmarks import run_all
    results = run_all.run(dry=True, out_path=str(tmp_path / "r.json"), modules=("tune_launch_configs",),
                          ops=["tune"], precompile_jobs=2, log=lambda s: None)
    n = len(tune.cases(True))
    assert {k: results["precompile"][k] for k in ("cases", "cases_run", "baselines_failed")} == \
        {"cases": n, "cases_run": n, "baselines_failed": 0}
    assert len(results["cases"]) == n and json.loads((tmp_path / "r.json").read_text())["precompile"]["cases_run"] == n


def test_the_command_line_precompiles_in_spawned_workers(tmp_path):
    """`python -m benchmarks.run_all --precompile-jobs N`, as gpu_check runs it: the workers find the
    function they run in the module run as __main__ (a spawned process imports it by name)."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--dry-run", "--ops", "softmax_sample",
                        "--precompile-jobs", "2", "--out", str(out)], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    n = len(results["cases"])
    assert n > 0 and results["precompile"]["cases"] == results["precompile"]["cases_run"] == n
    # a baseline that cannot run here (the cuda backend on CPU) fails in the workers as it is missing in the run
    missing = sum(r["status"] != "ok" for c in results["cases"] for r in c["results"])
    assert results["precompile"]["baselines_failed"] == missing > 0
