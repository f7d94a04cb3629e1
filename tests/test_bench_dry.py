"""The benchmark harness on CPU: the dry run exercises every code path except device timing, and the
GPU entry points refuse cleanly without a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import plot, run_all, timer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPS = ("fused_concat_down_proj", "q_only_paged_attention", "centroid_logits", "tree_verify", "dense_lm_head",
       "drafter_step", "draft_round")
COMPOSITIONS = {  # the PyTorch baselines that run anywhere: each must run and agree with the reference
    "hf_torch", "hf_torch_compile", "torch_gather_sdpa", "torch_gather_sdpa_compile", "hf_masked_embedder",
    "hf_masked_embedder_compile", "torch_argmax_python_walk", "torch_compile_argmax_python_walk", "torch_eager",
    "fp32_copy_sort",
}


def _env():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    d = tmp_path_factory.mktemp("dry")
    out, png = d / "dry.json", d / "dry.png"
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--dry-run", "--out", str(out), "--plot", str(png)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout, png


def test_dry_run_covers_every_op_and_reports_every_baseline(dry):
    results, _, _ = dry
    assert results["dry_run"] is True
    assert {c["op"] for c in results["cases"]} == set(OPS)
    for c in results["cases"]:
        assert c["bytes"] > 0 and c["floor_datasheet_s"]["H200"] > 0
        names = [r["baseline"] for r in c["results"]]
        assert "triton" in names and "cuda" in names, c["case"]
        for r in c["results"]:
            where = f"{c['case']} / {r['baseline']}"
            assert r["status"] in ("ok", "missing"), f"{where}: {r.get('reason')} {r.get('where', '')}"
            if r["status"] == "missing":
                assert r["reason"], where
            assert "time_s" not in r, f"{where}: a dry run must not report timings"
            if r["baseline"] in COMPOSITIONS:
                assert r["status"] == "ok", f"{where}: {r.get('reason')}"
                assert r["check"]["ok"] is True, f"{where}: {r['check']}"
            if r["baseline"] == "triton" and r["status"] == "ok":
                assert r["check"]["ok"] is True, f"{where}: triton disagrees with the reference: {r['check']}"


def test_missing_baselines_say_why(dry):
    results, _, _ = dry
    by_name = {(c["case"], r["baseline"]): r for c in results["cases"] for r in c["results"]}
    cuda = [r for (case, b), r in by_name.items() if b == "cuda"]
    assert cuda and all(r["status"] == "missing" for r in cuda)
    ext = [r for (case, b), r in by_name.items() if b in ("vllm_triton_unified", "flashinfer_decode", "flash_attn_kvcache")]
    assert len(ext) == 3 * sum(1 for c in results["cases"] if c["op"] == "q_only_paged_attention")
    assert all(r["status"] == "missing" and "CUDA" in r["reason"] for r in ext)


def test_dry_run_table_and_plot(dry, tmp_path):
    results, stdout, png = dry
    assert "DRY RUN" in stdout
    for op in OPS:
        assert op in stdout
    assert png.exists() and png.stat().st_size > 10_000
    # the table of a saved file, as gpu_check.sh prints it last
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--table", str(path), "--markdown"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.count("| fused_concat_down_proj |") >= 1, p.stderr


def test_table_and_plot_of_a_timed_file(dry, tmp_path):
    """The timed-columns path: a GPU results file's numbers (here written in by hand) reach the table
    and the plot."""
    results = json.loads(json.dumps(dry[0]))
    results["device_peaks"] = {"copy_bytes_per_s": 4.0e12, "launch_floor_s": 2e-6}
    case = results["cases"][0]
    case["floor_s"] = 5e-6
    first, second = case["results"][0], case["results"][1]
    first.update(time_s=20e-6, gbps=1.0, fraction_of_floor=0.25)
    second.update(time_s=10e-6, gbps=2.0, fraction_of_floor=0.5, speedup_vs_first=2.0)
    text = run_all.table(results)
    assert "20.00" in text and "50%" in text and "2.00x" in text and "4.00 TB/s" in text and "10.0" in text
    out = tmp_path / "timed.png"
    plot.plot(results, str(out))
    assert out.stat().st_size > 10_000


def test_gpu_case_grid_is_well_formed():
    """The real-shape grid that runs on a GPU: built here without inputs (no tensors allocated)."""
    import importlib
    labels = set()
    for modname in run_all.MODULES:
        mod = importlib.import_module(f"benchmarks.{modname}")
        cases = mod.cases(dry=False)
        assert cases, modname
        for c in cases:
            assert (c.op, c.label) not in labels, c.label
            labels.add((c.op, c.label))
            assert c.cost.bytes > 0 and {"triton", "cuda"} <= set(c.baselines)
    # the targets are measured: B=1 attention at >= 8K for head dims 512 and 256, centroid T=1 on E2B
    assert ("q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=8192") in labels
    assert ("q_only_paged_attention", "31B sliding D=256 B=1 Q=1 ctx=8192") in labels
    assert ("centroid_logits", "E2B argmax T=1") in labels
    # issue 11: steps and rounds of the four drafters at B = 1 / 8 / 32, 8K / 32K, the targets first
    assert ("drafter_step", "E2B step B=1 ctx=8192") in labels and ("drafter_step", "31B step B=32 ctx=32768") in labels
    assert ("draft_round", "31B chain round k=4 B=1 ctx=8192") in labels
    assert ("draft_round", "E4B tree round (2,2,1) B=8 ctx=32768") in labels


def test_rotating_sets_cover_three_l2s():
    l2 = 50 * 2**20
    assert timer.n_sets(1e9, l2) == 2  # one set already larger than L2: still rotate two
    assert timer.n_sets(3 * 2**20, l2) == 50  # 3 * 50 MiB / 3 MiB
    assert timer.n_sets(1000, l2) == 64  # capped


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_entry_points_refuse_without_gpu(tmp_path):
    env = _env()
    env["PYTHON"] = sys.executable
    env["OUT"] = str(tmp_path / "out")
    p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no GPU" in p.stdout and "Traceback" not in p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--out", str(tmp_path / "r.json")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "no GPU" in p.stderr and "Traceback" not in p.stdout + p.stderr


def test_timed_case_record_on_cpu():
    """The timed half of a case record (what a GPU run fills in), here with the host wall clock on
    CPU tensors and a device whose peaks are given: gbps, fraction of floor and speedup follow from
    the measured time and the case's bytes."""
    from benchmarks import bench_fused_concat_down_proj, devices

    case = bench_fused_concat_down_proj.cases(dry=True)[0]
    dev = devices.Device("test", "test", 1e9, 1e12, 0, 1, source="measured")
    rec = run_all._run_case(case, torch=torch, dry=False, device=torch.device("cpu"), dtype=torch.float32,
                            l2_bytes=0, measured_dev=dev, datasheet=list(devices.DATASHEET.values()), timer=timer,
                            runs=3)
    assert rec["floor_s"] == pytest.approx(case.cost.bytes / 1e9)
    hf = next(r for r in rec["results"] if r["baseline"] == "hf_torch")
    assert hf["status"] == "ok" and hf["method"] == "cpu-wallclock" and hf["check"]["ok"]
    assert hf["gbps"] == pytest.approx(case.cost.bytes / hf["time_s"] / 1e9)
    assert hf["fraction_of_floor"] == pytest.approx(rec["floor_s"] / hf["time_s"])
    assert hf["speedup_vs_first"] == pytest.approx(1.0)
    cuda = next(r for r in rec["results"] if r["baseline"] == "cuda")
    assert cuda["status"] == "missing" and "time_s" not in cuda
