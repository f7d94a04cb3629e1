"""The benchmark harness on CPU: the dry run exercises every code path except device timing, and the
GPU entry points refuse cleanly without a GPU."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks import plot, run_all, timer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OPS = ("fused_concat_down_proj", "q_only_paged_attention", "centroid_logits", "tree_verify", "dense_lm_head",
       "rms_norm_linear", "rms_norm_gate_up", "rms_norm_q_rope", "drafter_step", "draft_round", "softmax_sample")
COMPOSITIONS = {  # the PyTorch baselines that run anywhere: each must run and agree with the reference
    "hf_torch", "hf_torch_compile", "torch_gather_sdpa", "torch_gather_sdpa_compile", "hf_masked_embedder",
    "hf_masked_embedder_compile", "torch_argmax_python_walk", "torch_compile_argmax_python_walk", "torch_eager",
    "fp32_copy_sort", "torch_composition", "torch_composite", "torch_composite_compile",
}


def _env():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("GEMMA4_MTP_VLLM_UNIFIED_ATTENTION", None)
    return env


# A stand-in for the stubbed copy of vLLM's kernel file (benchmarks/vllm_anchor.py): it records every
# call and computes what vLLM's unified_attention computes (query i of a request at position
# seq_len - q_len + i; causal: keys up to it; sliding window: keys from position - window_size[0]),
# and, like vLLM's split-K path, writes the softmax scratch when it is given some. What it tests is our
# harness: the arguments it builds and what it records about the call.
FAKE_VLLM = """
    import json
    import torch
    GEMMA4_MTP_ANCHOR = {{"vllm_version": "0.0-fake", "source": "test_bench_dry.py"}}
    MAX_3D_QUERY_LEN = 8

    def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                          window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                          num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                          softmax_segm_expsum=None):
        scratch = softmax_segm_output is not None
        with open({log!r}, "a") as f:
            f.write(json.dumps(dict(
                q=list(q.shape), k=list(k.shape), out=list(out.shape), cu_seqlens_q=cu_seqlens_q.tolist(),
                max_seqlen_q=max_seqlen_q, seqused_k=seqused_k.tolist(), max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale, causal=causal, window_size=list(window_size),
                block_table=list(block_table.shape), softcap=softcap, seq_threshold_3D=seq_threshold_3D,
                num_par_softmax_segments=num_par_softmax_segments,
                scratch=[[list(t.shape), str(t.dtype)] for t in (softmax_segm_output, softmax_segm_max,
                                                                 softmax_segm_expsum)] if scratch else None)) + "\\n")
        bs, Hkv = k.shape[1], k.shape[2]
        for b in range(len(seqused_k)):
            lo, hi, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
            keys = torch.cat([k[block_table[b, j // bs], j % bs][None] for j in range(n)])
            vals = torch.cat([v[block_table[b, j // bs], j % bs][None] for j in range(n)])
            for i in range(hi - lo):
                pos = n - (hi - lo) + i
                ok = torch.ones(n, dtype=torch.bool)
                if causal:
                    ok &= torch.arange(n) <= pos
                if window_size[0] >= 0:
                    ok &= torch.arange(n) >= pos - window_size[0]
                for h in range(q.shape[1]):
                    g = h // (q.shape[1] // Hkv)
                    s = (keys[:, g].double() @ q[lo + i, h].double()) * softmax_scale
                    p = torch.softmax(s.masked_fill(~ok, float("-inf")), 0)
                    out[lo + i, h] = (p @ vals[:, g].double()).to(out.dtype)
        if scratch:
            softmax_segm_max.zero_()
"""


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_vllm")
    log = d / "calls.jsonl"
    path = d / "triton_unified_attention.py"
    path.write_text(textwrap.dedent(FAKE_VLLM.format(log=str(log))))
    return path, log


@pytest.fixture(scope="module")
def dry(tmp_path_factory, fake_vllm):
    d = tmp_path_factory.mktemp("dry")
    out, png = d / "dry.json", d / "dry.png"
    env = dict(_env(), GEMMA4_MTP_VLLM_UNIFIED_ATTENTION=str(fake_vllm[0]))
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--dry-run", "--out", str(out), "--plot", str(png)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
    ext = [r for (case, b), r in by_name.items() if b in ("flashinfer_decode", "flash_attn_kvcache")]
    assert len(ext) == 2 * sum(1 for c in results["cases"] if c["op"] == "q_only_paged_attention")
    assert all(r["status"] == "missing" and "CUDA" in r["reason"] for r in ext)


def test_vllm_anchor_is_called_as_vllms_triton_backend_calls_it_for_decode(dry, fake_vllm):
    """Split-K: seq_threshold_3D = 128 // Hkv, 16 segments, fp32 scratch [rows, Hq, 16, next_pow2(D)] for
    every query token, causal as vLLM's decode metadata; the 2D baseline: no scratch, non-causal. The
    results say where the kernel file came from (path, sha256, version) and how it was called."""
    results, _, _ = dry
    path, log = fake_vllm
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cases = [c for c in results["cases"] if c["op"] == "q_only_paged_attention"]
    assert len(calls) >= len(cases)
    for c in cases:
        p = c["params"]
        B, Q, Hq, Hkv, D = p["B"], p["Q"], p["Hq"], p["Hkv"], p["D"]
        mine = [x for x in calls if x["q"] == [B * Q, Hq, D] and x["k"][2] == Hkv and x["max_seqlen_k"] == p["ctx"]]
        split = [x for x in mine if x["scratch"]]
        flat = [x for x in mine if not x["scratch"]]
        assert split and bool(flat) == (Q > 1), c["case"]  # the 2D call only where Q > 1
        for x in mine:
            assert x["cu_seqlens_q"] == list(range(0, B * Q + 1, Q)) and x["max_seqlen_q"] == Q
            assert x["seqused_k"] == [p["ctx"]] * B and x["softmax_scale"] == 1.0 and x["softcap"] == 0
            assert x["window_size"] == ([p["window"] - 1, 0] if p["window"] else [-1, -1])
            assert x["out"] == x["q"] and x["block_table"][0] == B
        d_pad = 1 << (D - 1).bit_length()
        for x in split:
            assert x["causal"] is True and x["seq_threshold_3D"] == 128 // Hkv and x["num_par_softmax_segments"] == 16
            (out_shape, out_dt), (max_shape, max_dt), (sum_shape, sum_dt) = x["scratch"]
            rows = out_shape[0]
            assert rows >= B * Q and out_shape == [rows, Hq, 16, d_pad] and max_shape == sum_shape == [rows, Hq, 16]
            assert out_dt == max_dt == sum_dt == "torch.float32"
        assert all(x["causal"] is False and x["seq_threshold_3D"] is None for x in flat)
        res = {r["baseline"]: r for r in c["results"]}
        assert ("vllm_unified_2d" in res) == (Q > 1)
        for name, path_taken in (("vllm_unified_splitk", "3d (split-K)"), ("vllm_unified_2d", "2d")):
            if name not in res:
                continue
            r = res[name]
            assert r["status"] == "ok", r
            prov = r["provenance"]
            assert prov["path"] == str(path) and prov["sha256"] == digest and prov["vllm_version"] == "0.0-fake"
            assert prov["call"]["path"] == path_taken and prov["call"]["causal"] is (name == "vllm_unified_splitk")
            if Q == 1 or (name == "vllm_unified_2d" and not p["window"]):
                assert r["check"]["ok"] is True, (c["case"], name, r["check"])
            else:  # vLLM's semantics differ from this op's there: reported, not compared
                assert r["check"]["ok"] is None and "different function" in r["check"]["detail"]
        assert res["vllm_unified_splitk"]["provenance"]["call"]["seq_threshold_3D"] == 128 // Hkv


def test_vllm_anchor_missing_or_refused_says_why(tmp_path, monkeypatch):
    from benchmarks import bench_q_only_attention, common, vllm_anchor

    case = bench_q_only_attention.cases(dry=True)[0]
    inputs = case.make_inputs(torch.device("cpu"), torch.float32, 0)
    monkeypatch.delenv(vllm_anchor.ENV, raising=False)
    with pytest.raises(common.Missing, match=vllm_anchor.ENV):
        case.baselines["vllm_unified_splitk"](inputs)
    inside = os.path.join(ROOT, "benchmarks", "triton_unified_attention.py")
    monkeypatch.setenv(vllm_anchor.ENV, inside)
    with pytest.raises(common.Missing, match="inside this repository and not ignored"):
        case.baselines["vllm_unified_splitk"](inputs)
    with pytest.raises(SystemExit, match="inside this repository and not ignored"):
        vllm_anchor.make_copy(os.path.join(ROOT, "anchor"), None)
    # a git-ignored directory of the work tree is fine: a GPU session can carry it, git never commits it
    assert vllm_anchor.repo_problem(os.path.join(ROOT, "build", "vllm_anchor", "triton_unified_attention.py")) is None
    assert vllm_anchor.repo_problem(str(tmp_path / "x.py")) is None
    monkeypatch.setenv(vllm_anchor.ENV, str(tmp_path / "nope.py"))
    with pytest.raises(common.Missing, match="not a file"):
        case.baselines["vllm_unified_splitk"](inputs)


def _interpreter_runs_vllm() -> bool:
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)


@pytest.mark.skipif(not os.environ.get("GEMMA4_MTP_VLLM_UNIFIED_ATTENTION"),
                    reason="needs a stubbed copy of vLLM's kernel (python -m benchmarks.vllm_anchor --make-copy DIR)")
def test_real_vllm_copy_computes_what_we_expect():
    """vLLM's own kernel (the copy named by the environment), on the GPU when there is one, else under
    the Triton interpreter on CPU: its split-K path runs and agrees with our reference at Q = 1, and
    with Q > 1 it computes the functions the benchmark says it does (causal verify; per-position window)."""
    import gemma4_mtp_kernels as gk
    from benchmarks import bench_q_only_attention as bq, vllm_anchor

    cuda = torch.cuda.is_available()
    if not cuda and not _interpreter_runs_vllm():
        pytest.skip("Triton < 3.8's interpreter cannot run vLLM's kernel (it compiles and runs on a GPU with 3.6)")
    device, dtype, tol = ((torch.device("cuda"), torch.bfloat16, 2e-2) if cuda else
                          (torch.device("cpu"), torch.float32, 1e-5))
    mod, _ = vllm_anchor.load()
    for B, Q, Hq, Hkv, D, ctx, window in ((2, 1, 4, 1, 128, 40, None), (1, 1, 8, 2, 64, 33, 24), (2, 3, 4, 1, 64, 40, None),
                                          (1, 3, 4, 2, 64, 40, 24)):
        i = bq._inputs(B, Q, Hq, Hkv, D, ctx, 16)(device, dtype, 0)
        args = (i["q"], i["k_cache"], i["v_cache"], i["block_table"], i["seq_lens"])
        for split_k in (True, False):
            run, how = bq.vllm_call(mod, *args, ctx=ctx, window=window, split_k=split_k)
            assert how["path"] == ("3d (split-K)" if split_k else "2d")
            out = run()
            for qi in range(Q):
                pos = ctx - Q + qi
                if split_k:  # causal: keys up to pos, then the window back from pos
                    lens, win = i["seq_lens"] - (Q - 1 - qi), window
                else:  # non-causal: keys to the end, the window back from pos
                    lens, win = i["seq_lens"], (ctx - (pos - window + 1)) if window else None
                ref = gk.q_only_paged_attention(i["q"][:, qi:qi + 1].contiguous(), i["k_cache"], i["v_cache"],
                                                i["block_table"], lens, scale=1.0, window=win, backend="torch")
                torch.testing.assert_close(out[:, qi:qi + 1], ref, rtol=tol, atol=tol)


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
    labels, baselines = set(), {}
    for modname in run_all.MODULES:
        mod = importlib.import_module(f"benchmarks.{modname}")
        cases = mod.cases(dry=False)
        assert cases, modname
        for c in cases:
            assert (c.op, c.label) not in labels, c.label
            labels.add((c.op, c.label))
            baselines[c.label] = set(c.baselines)
            assert c.cost.bytes > 0 and {"triton", "cuda"} <= set(c.baselines)
    # the targets are measured: B=1 attention at >= 8K for head dims 512 and 256, centroid T=1 on E2B
    assert ("q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=8192") in labels
    assert ("q_only_paged_attention", "31B sliding D=256 B=1 Q=1 ctx=8192") in labels
    assert ("centroid_logits", "E2B argmax T=1") in labels
    # issue 11: steps and rounds of the four drafters at B = 1 / 8 / 32, 8K / 32K, the targets first
    assert ("drafter_step", "E2B step B=1 ctx=8192") in labels and ("drafter_step", "31B step B=32 ctx=32768") in labels
    assert ("draft_round", "31B chain round k=4 B=1 ctx=8192") in labels
    assert ("draft_round", "E4B tree round (2,2,1) B=8 ctx=32768") in labels
    # the two GEMV designs of the fused glue on the same bytes (31B's largest projections, E2B's)
    assert ("rms_norm_gate_up", "31B gate_up T=1") in labels and ("rms_norm_q_rope", "E2B q_proj full T=1") in labels
    # what programmatic dependent launch saves: every step, the B = 1 rounds
    assert "triton_no_pdl" in baselines["31B step B=32 ctx=32768"]
    assert "triton_no_pdl" in baselines["E2B chain round k=4 B=1 ctx=8192"]
    assert "triton_no_pdl" not in baselines["E2B chain round k=4 B=8 ctx=8192"]
    # what the sliding layers' in-kernel attention merge saves: the B = 1 steps
    assert "triton_merge_kernel" in baselines["E2B step B=1 ctx=8192"]
    assert "triton_merge_kernel" in baselines["31B step B=1 ctx=32768"]
    assert "triton_merge_kernel" not in baselines["E2B step B=8 ctx=8192"]
    # the next kernel scheduled at each kernel's exit instead of after its wait: the B = 1 steps
    assert "triton_pdl_at_exit" in baselines["31B step B=1 ctx=8192"]
    assert "triton_pdl_at_exit" not in baselines["31B step B=8 ctx=8192"]
    # the GEMV kernels without their weight prefetch before the wait: the B = 1 steps
    assert "triton_no_prefetch" in baselines["31B step B=1 ctx=8192"]
    assert "triton_no_prefetch" not in baselines["31B step B=8 ctx=8192"]


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


def _toy_cases(lose_in=None):
    """Two cases of a toy op; each baseline returns the reference's tensor. lose_in: the baseline after
    which the (fake) device synchronisation raises, as it does after a sticky CUDA error."""
    from benchmarks.common import Case
    from benchmarks.roofline import Cost

    def case(label):
        return Case(op="toy", label=label, params={}, cost=Cost("toy", {"activations": 4.0}),
                    make_inputs=lambda device, dtype, seed: {"x": torch.ones(3)}, reference=lambda i: i["x"],
                    baselines={b: (lambda i: (lambda: i["x"])) for b in ("torch", "triton", "cuda", "cuda_eager")},
                    default_compare=lambda o, r: {"ok": bool(torch.equal(o, r))})
    return [case("first"), case("second")]


class _FakeTorch:
    """What _run_case asks of torch on a GPU: cuda.synchronize, raising after baseline `lose_in`."""

    def __init__(self, lose_in):
        self.lose_in, self.calls = lose_in, []
        self.cuda = self

    def synchronize(self):
        self.calls.append(len(self.calls))
        if self.lose_in is not None and len(self.calls) > self.lose_in:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_lost_cuda_context_ends_the_case_naming_its_baseline():
    """After a sticky CUDA error nothing more can run in the process: the case's record ends with the
    baseline that raised (error) and the ones after it (not run), and ContextLost names it."""
    case = _toy_cases()[0]
    kw = dict(dry=True, device=torch.device("cuda"), dtype=torch.float32, l2_bytes=0, measured_dev=None,
              datasheet=[], timer=timer, runs=1)
    with pytest.raises(run_all.ContextLost) as lost:
        run_all._run_case(case, torch=_FakeTorch(lose_in=2), **kw)  # torch, triton pass; cuda loses it
    assert lost.value.baseline == "cuda"
    got = {r["baseline"]: r for r in lost.value.rec["results"]}
    assert [got[b]["status"] for b in ("torch", "triton", "cuda", "cuda_eager")] == ["ok", "ok", "error", "not run"]
    assert "illegal memory access" in got["cuda"]["reason"] and "cuda" in got["cuda_eager"]["reason"]
    rec = run_all._run_case(case, torch=_FakeTorch(lose_in=None), skip={"cuda": "skipped: lost before"}, **kw)
    assert [r["status"] for r in rec["results"]] == ["ok", "ok", "not run", "not run"]


def test_resume_keeps_the_finished_cases_and_skips_the_lost_baselines(tmp_path, monkeypatch):
    """run_all writes what finished and exits 3 when the context is lost; --resume --skip-baselines then
    runs only the cases not yet recorded, without the baselines starting with the given prefixes."""
    import types

    fake = types.ModuleType("benchmarks.bench_toy")
    fake.cases = lambda dry: _toy_cases()
    monkeypatch.setitem(sys.modules, "benchmarks.bench_toy", fake)
    monkeypatch.setattr(run_all, "MODULES", ("bench_toy",))
    out = str(tmp_path / "results.json")
    real = run_all._run_case

    def lose_in_second(case, **kw):
        rec = real(case, **kw)
        if case.label == "second":
            raise run_all.ContextLost(case.label, "cuda", rec)
        return rec
    monkeypatch.setattr(run_all, "_run_case", lose_in_second)
    assert run_all.main(["--dry-run", "--out", out]) == 3
    written = json.load(open(out))
    assert written["context_lost"] == {"case": "second", "baseline": "cuda"}
    assert [c["case"] for c in written["cases"]] == ["first", "second"]
    # the lost case is kept as recorded; a case that never ran is run on resume
    written["cases"] = written["cases"][:1]
    json.dump(written, open(out, "w"))
    monkeypatch.setattr(run_all, "_run_case", real)
    assert run_all.main(["--dry-run", "--out", out, "--resume", "--skip-baselines", "cuda"]) == 0
    resumed = json.load(open(out))
    assert [c["case"] for c in resumed["cases"]] == ["first", "second"]
    assert resumed["cases"][0] == written["cases"][0]
    assert [r["status"] for r in resumed["cases"][1]["results"]] == ["ok", "ok", "not run", "not run"]
    assert resumed["lost_contexts"] == [{"case": "second", "baseline": "cuda"}] and "context_lost" not in resumed


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"), reason="nvcc not found")
def test_stage_boundary_builds_and_fails_cleanly_without_a_gpu(tmp_path):
    """bench_stage_boundary's own nvcc command (the program's sources and includes, not only the
    compile that tests/test_cuda_build.py checks) builds here; with no device the program names the
    CUDA error, the benchmark returns 1 and writes no results."""
    from benchmarks import bench_stage_boundary

    out = tmp_path / "stage_boundary.json"
    assert bench_stage_boundary.main(["--out", str(out), "--build-dir", str(tmp_path / "build")]) == 1
    exe = tmp_path / "build" / "stage_boundary"
    assert exe.exists()
    assert not out.exists()
    # the program takes the drafters' shapes the benchmark passes (it fails at the device, after its arguments),
    # and names an argument it cannot read before touching the device
    done = subprocess.run([str(exe), *bench_stage_boundary.shape_args()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cudaGetDevice" in done.stderr, done.stderr
    for bad, named in (("step=256:3072:0:0,sliding", "step=256:3072:0:0,sliding: expected n:k:norm:glu[:window]"),
                       ("wide=1024:256:1", "wide=1024:256:1: expected n:k:norm:glu[:window]"),
                       ("attention=8:512:4", "attention=8:512:4: expected heads:dim:kv_heads:ctx"),
                       ("sliding_layer=" + ",".join(["8:8:0:0"] * 33), "(at most 32)")):
        done = subprocess.run([str(exe), bad], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and named in done.stderr, (bad, done.stderr)


def test_stage_boundary_keeps_the_rows_of_a_run_that_hangs(tmp_path, monkeypatch):
    """A row that never finishes on the GPU (a hang the emulation did not show) must not cost the rows timed
    before it: at --time-limit the program is stopped, and the JSON keeps its whole rows (its sections' rows
    printed and flushed one by one, as stage_boundary.cu prints them), the row it stopped in named, and the
    benchmark's status 124."""
    from benchmarks import bench_stage_boundary

    fake = tmp_path / "stage_boundary"
    fake.write_text("#!/bin/sh\n"
                    "printf '{\"device\": \"X\", \"sms\": 132, \"cc\": \"9.0\", \"n\": 2048, \"stages\": 32, "
                    "\"results\": ['\n"
                    "printf '\\n  {\"mode\": \"pdl\", \"programs\": 8, \"graph\": true, \"ok\": true, "
                    "\"us_per_stage\": 1.3, \"us_one_stage\": 3.1}'\n"
                    "printf '\\n], \"gemv\": ['\n"
                    "printf '\\n  {\"layer\": \"sliding\", \"programs\": 16, \"layers\": 1, \"stages\": 5, "
                    "\"bytes\": 4718592, \"ok\": true, \"us\": 7.5}'\n"
                    "printf ',\\n  {\"layer\": \"sliding\", \"programs\": 16, \"layers\": 4'\n"
                    "exec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bench_stage_boundary, "build", lambda out_dir: fake)
    out = tmp_path / "stage_boundary.json"
    assert bench_stage_boundary.main(["--out", str(out), "--time-limit", "6"]) == 124
    got = json.loads(out.read_text())
    assert [r["mode"] for r in got["results"]] == ["pdl"]
    assert got["gemv"] == [{"layer": "sliding", "programs": 16, "layers": 1, "stages": 5, "bytes": 4718592, "ok": True,
                           "us": 7.5}]
    assert got["cut_short_in"] == '{"layer": "sliding", "programs": 16, "layers": 4'
    assert got["exit_status"] == 124
    assert "stopped in the row" in bench_stage_boundary.table(got, markdown=True)


def test_stage_boundary_table_shows_every_section():
    """bench_stage_boundary.table renders each section's rows (text and markdown): the cluster chains, the stream
    rates, the layers in one cluster with their per-layer slope, the ring GEMVs and the attention rows named by
    drafter_shapes, and a skipped or failed row's reason."""
    from benchmarks import bench_stage_boundary as bsb

    results = {"device": "X", "sms": 132, "cc": "9.0", "n": 2048, "stages": 32,
               "results": [{"mode": "cluster_push", "programs": 16, "graph": True, "ok": True, "us_per_stage": 0.45,
                            "us_one_stage": 2.0}],
               "stream": [{"source": "l2", "programs": 16, "bytes_per_program": 262144, "ok": True,
                           "us_per_pass": 2.0, "gb_per_s_per_program": 131.1, "tb_per_s": 2.1}],
               "gemv": [{"layer": "sliding", "programs": 16, "layers": 1, "stages": 5, "bytes": 4718592, "ok": True,
                         "us": 8.0},
                        {"layer": "sliding", "programs": 16, "layers": 4, "stages": 20, "bytes": 18874368,
                         "ok": True, "us": 20.0},
                        {"layer": "step", "programs": 16, "stages": 21, "bytes": 1, "ok": False, "us": 30.0},
                        {"layer": "step", "programs": 2, "stages": 21, "bytes": 1, "skipped": "too few"}],
               "wide_gemv": [{"n": 1024, "k": 16384, "norm": 0, "programs": 128, "bytes": 33554432, "copies": 5,
                              "ok": True, "us": 11.0}],
               "attention": [{"heads": 4, "dim": 512, "kv_heads": 1, "ctx": 8192, "programs": 128, "bytes": 16777216,
                              "copies": 10, "ok": True, "us": 8.0},
                             {"heads": 4, "dim": 512, "kv_heads": 1, "ctx": 8192, "programs": 120, "bytes": 16777216,
                              "skipped": "not whole clusters"},
                             {"heads": 8, "dim": 512, "kv_heads": 4, "ctx": 8192, "kernel": "mma", "programs": 128,
                              "bytes": 67108864, "copies": 2, "ok": True, "us": 20.0}]}
    bsb.name_wide_rows(results)
    bsb.name_attention_rows(results)
    assert results["wide_gemv"][0]["shape"] == "31B o_proj full"
    assert [(r["layer"], r["kernel"]) for r in results["attention"]] == [("E2B full", "scalar"), ("E2B full", "scalar"),
                                                                           ("31B full", "mma")]
    for markdown in (False, True):
        out = bsb.table(results, markdown=markdown)
        assert "31B o_proj full" in out and "3.05" in out  # 32 MiB in 11 µs: 3.05 TB/s
        assert "4.00" in out  # the sliding layer's slope: (20 - 8) / 3
        assert "WRONG RESULT" in out and "skipped: too few" in out and "skipped: not whole clusters" in out
        assert "131" in out and "0.45" in out  # the stream row's GB/s a program, the push chain's µs a stage
    md = bsb.table(results, markdown=True)
    assert "| E2B full | scalar | 8192 | 128 | 16 | 8.00 | 2.10 | ok |" in md  # 16 MiB in 8 µs
    assert "| 31B full | mma | 8192 | 128 | 64 | 20.00 | 3.36 | ok |" in md  # 64 MiB in 20 µs


def test_the_drafter_step_module_gets_half_the_budget():
    from benchmarks import run_all
    mods = list(run_all.MODULES)
    assert mods[0] == "bench_drafter_step"
    assert run_all.share(mods, 120.0) == pytest.approx(60.0)
    assert run_all.share(mods[1:], 70.0) == pytest.approx(10.0)  # the other seven share the rest equally
    assert run_all.share(mods[-1:], 7.0) == pytest.approx(7.0)


def test_head_apart_rows_make_the_heads_calls_after_the_steps():
    """cuda_eager_head_apart (B = 1 steps and sampled chain rounds): each level's head as calls of their own
    after the step's, drawing the same tokens (on the CPU, the reference backend) as the head in the step's
    call."""
    from unittest import mock

    from benchmarks import bench_drafter_step as b
    from gemma4_mtp.drafter import Gemma4MTPDrafter

    grid = {c.label: set(c.baselines) for c in b.cases(dry=False)}
    assert "cuda_eager_head_apart" in grid["E2B sampled chain round k=4 T=0.8 B=1 ctx=8192"]
    assert "cuda_eager_head_apart" in grid["31B step B=1 ctx=8192"]
    assert "cuda_eager_head_apart" not in grid["E2B sampled chain round k=4 T=0.8 B=8 ctx=8192"]
    case = next(c for c in b.cases(dry=True) if "sampled" in c.label)
    inp = case.make_inputs(torch.device("cpu"), torch.float32, 0)
    with mock.patch.object(Gemma4MTPDrafter, "step_sample_tokens", autospec=True,
                           side_effect=Gemma4MTPDrafter.step_sample_tokens) as in_call:
        together = b.run_ours(inp, "torch", "sampled")
        assert in_call.call_count == len(b.SHAPES["sampled"])
        in_call.reset_mock()
        assert torch.equal(b.run_ours(inp, "torch", "sampled", head_apart=True), together)
        assert in_call.call_count == 0
