"""The committed GPU runs (benchmarks/results/<run>/) are complete, and the README tables are what
benchmarks.readme_tables draws from them."""
import glob
import json
import os
import subprocess
import sys

import pytest

from benchmarks import make_verified, readme_tables, run_all
from benchmarks.bench_stage_boundary import STEP_STAGES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = sorted(p for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*", "results.json"))
              if not os.path.basename(os.path.dirname(p)).startswith("gpu_check_"))  # gpu_check.sh's uncommitted $OUT


def test_committed_readme_tables_are_what_the_results_give():
    p = subprocess.run([sys.executable, "-m", "benchmarks.readme_tables", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("path", RUNS, ids=[os.path.basename(os.path.dirname(p)) for p in RUNS])
def test_each_committed_run_has_its_files(path):
    d = os.path.dirname(path)
    for name in ("README.md", "gpu_suite.json", "roofline.png", "summary.txt"):
        assert os.path.exists(os.path.join(d, name)), f"{d} lacks {name}"
    with open(path) as f:
        results = json.load(f)
    assert results["dry_run"] is False and results["env"]["device"] and results["env"]["commit"]
    with open(os.path.join(d, "summary.txt")) as f:
        assert f.read().rstrip("\n") == run_all.table(results)
    with open(os.path.join(d, "gpu_suite.json")) as f:
        suite = json.load(f)
    for per in suite["ops"].values():
        for s in per.values():
            assert isinstance(s["passed"], bool) and s["why"]


def _run(cases, passed=()):
    ops = {}
    for op, b in passed:
        ops.setdefault(op, {})[b] = {"passed": True}
    return make_verified.Run("r", {"dtype": "bfloat16", "cases": cases, "device_peaks": {},
                                   "env": {"device": "GPU", "date": "2026-12-02", "commit": "abcdef0"}},
                             {"ops": ops, "complete": True})


def _r(b, us, ok=True, **kw):
    return {"baseline": b, "status": "ok", "time_s": us * 1e-6, "check": {"ok": ok}, **kw}


def test_tables_pick_the_fastest_real_anchor_and_show_failures(monkeypatch):
    monkeypatch.setattr(make_verified, "REWRITTEN", {})  # the kernels this made-up run tested are today's
    case = {"op": "q_only_paged_attention", "case": "c1", "floor_s": 5e-6, "results": [
        _r("torch_gather_sdpa", 100.0), _r("triton", 10.0, fraction_of_floor=0.5), _r("cuda", 8.0, ok=False),
        _r("vllm_unified_2d", 1.0),  # not what vLLM runs for decode: never the anchor
        _r("vllm_unified_splitk", 20.0, ok=None),  # computes another function: still an anchor
        {"baseline": "flashinfer_decode", "status": "missing", "reason": "x"}]}
    case2 = {"op": "q_only_paged_attention", "case": "c2", "floor_s": None, "results": [
        _r("torch_gather_sdpa", 10.0), {"baseline": "triton", "status": "error", "reason": "boom"},
        _r("cuda", 40.0)]}
    run = _run([case, case2], passed=[("q_only_paged_attention", "triton")])
    text = readme_tables.cases_table([run])
    assert "| q_only_paged_attention | c1 | 5.0 | 10.0 (50%) | 8.0 MISMATCH | vllm_unified_splitk | 20.0 |" in text
    assert "| q_only_paged_attention | c2 | - | error | 40.0 | torch_gather_sdpa | 10.0 |" in text
    summary = readme_tables.summary_table([run])
    # ours: triton 10 vs anchor 20 (c1: cuda disagreed with the reference, not counted); cuda 40 vs 10 (c2)
    assert "| q_only_paged_attention | 2 | 50% (1) | - | 1 of 2 | 1.41 | triton |" in summary


def test_our_own_drafter_variants_are_never_the_anchor():
    """A step's triton_no_pdl / eager / torch rows are our drafter under other switches: the anchor to
    beat is Hugging Face's assistant (on 2026-12-04 triton_no_pdl beat triton on 31B and the table said
    ours never beat an anchor)."""
    case = {"op": "drafter_step", "case": "31B step", "floor_s": 2.5e-4, "results": [
        _r("hf_assistant", 6800.0, ok=None), _r("triton", 523.0), _r("cuda", 598.0), _r("triton_no_pdl", 506.0),
        _r("triton_merge_kernel", 531.0), _r("triton_eager", 2700.0), _r("cuda_eager", 1600.0),
        _r("torch_eager", 8800.0)]}
    text = readme_tables.cases_table([_run([case])])
    assert "| hf_assistant | 6800.0 |" in text


def test_rewrite_needs_the_markers_and_replaces_only_between_them():
    begin, end = readme_tables._begin("cases"), readme_tables._end("cases")
    text = f"a\n{begin}\nold\n{end}\nb\n"
    assert readme_tables.rewrite(text, "cases", "new\n", "f") == f"a\n{begin}\nnew\n{end}\nb\n"
    with pytest.raises(SystemExit, match="needs one"):
        readme_tables.rewrite("no markers", "cases", "new\n", "f")


def test_stage_boundary_table_of_the_newest_run_that_has_one(tmp_path):
    """A run's stage_boundary.json (bench_stage_boundary) becomes the stage-boundary table of
    benchmarks/README.md: µs per stage and a B = 1 step's STEP_STAGES of them per (mode, programs), skips and
    errors by name;
    a run without one is passed over, and with none at all the table says so."""
    sb = {"device": "GPU", "sms": 132, "cc": "9.0", "n": 2048, "stages": 32, "env": {"commit": "1234567abc"},
          "results": [{"mode": "pdl", "programs": 132, "ok": True, "graph": True, "us_one_stage": 4.0,
                       "us_all_stages": 50.0, "us_per_stage": 1.5},
                      {"mode": "barrier", "programs": 264, "skipped": "not resident at once"},
                      {"mode": "barrier_fence", "programs": 8, "error": "cudaGraphLaunch: boom"}]}
    old, new = _run([]), _run([])
    old.results["env"]["date"], new.results["env"]["date"] = "2026-12-01", "2026-12-05"
    assert readme_tables.stage_boundary_table([old, new]) == "No stage-boundary measurement is committed yet.\n"
    old.stage_boundary = sb
    text = readme_tables.stage_boundary_table([old, new])  # the newer run has none: the older one's table
    assert text.startswith("`benchmarks/results/r/stage_boundary.json`, commit 1234567: GPU (132 SMs, sm_90)")
    assert f"| pdl | 132 | 1.50 | 4.00 | {1.5 * STEP_STAGES:.1f} | ok |" in text  # 24 stages: 36.0
    assert "| barrier | 264 | - | - | - | skipped: not resident at once |" in text
    assert "| barrier_fence | 8 | - | - | - | ERROR: cudaGraphLaunch: boom |" in text
    # load_runs reads it from the run's directory
    run_dir = tmp_path / "2026-12-05-h200"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps({**new.results, "dry_run": False}))
    (run_dir / "stage_boundary.json").write_text(json.dumps(sb))
    (loaded,) = make_verified.load_runs(str(tmp_path))
    assert loaded.stage_boundary == sb
