"""`auto` from evidence: benchmarks.make_verified turns committed GPU runs into gemma4_mtp_kernels/verified.py
(device, op, shape range -> the fastest backend that passed the GPU suite there), benchmarks.gpu_suite
turns a per-file pytest run into the suite's verdict per (op, backend), and the dispatcher follows the
table. Dispatch logic only: the backends' status and the device name are set by the tests."""
import contextlib
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import gemma4_mtp_kernels as g
from gemma4_mtp_kernels import _dispatch, verified
from benchmarks import gpu_suite, make_verified, run_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = "NVIDIA H200"
OP = "fused_concat_down_proj"


# ---------------------------------------------------------------- synthetic runs for the generator

def _case(op, label, params, times: dict, checks: dict | None = None):
    res = []
    for b, t in times.items():
        ok = (checks or {}).get(b, True)
        res.append({"baseline": b, "status": "ok", "time_s": t * 1e-6, "check": {"ok": ok}} if t is not None
                   else {"baseline": b, "status": "missing", "reason": "x"})
    return {"op": op, "case": label, "params": params, "results": res}


def _down(T, Hb=64, Hd=32, **times):
    return _case(OP, f"T={T} Hb={Hb}", {"drafter": "t", "Hb": Hb, "Hd": Hd, "T": T}, times)


def _write_run(root, name, cases, *, passed, device=H200, date="2026-12-10T00:00:00+00:00", dry=False):
    d = root / name
    d.mkdir(parents=True)
    results = {"schema": 1, "dry_run": dry, "dtype": "bfloat16", "cases": cases,
               "env": {"device": device, "date": date, "commit": "abc"}}
    (d / "results.json").write_text(json.dumps(results))
    if passed is not None:
        ops = {}
        for (op, b), ok in passed.items():
            ops.setdefault(op, {})[b] = {"passed": ok}
        (d / "gpu_suite.json").write_text(json.dumps({"schema": 1, "complete": True, "ops": ops}))
    return d


def _table(root):
    runs = make_verified.load_runs(str(root))
    return make_verified.evidence(runs)


ALL_PASS = {(OP, "cuda"): True, (OP, "triton"): True}


def test_generator_picks_the_fastest_backend_that_passed(tmp_path):
    _write_run(tmp_path, "r", [_down(1, triton=9.0, cuda=3.0), _down(8, triton=9.0, cuda=7.0),
                               _down(64, triton=11.0, cuda=60.0)], passed=ALL_PASS)
    entries = _table(tmp_path)[(H200, OP, "bfloat16")]
    assert [(e[1], e[2]) for e in entries] == [(("T", 1, 8), "cuda"), (("T", 64, 64), "triton")]
    assert entries[0][0] == (("Hb", 64), ("Hd", 32))
    assert "r: T=1 Hb=64: cuda 3.0 us, triton 9.0 us" in entries[0][3]


def test_a_backend_that_failed_the_suite_or_the_check_is_never_chosen(tmp_path):
    _write_run(tmp_path, "r", [_down(1, triton=9.0, cuda=3.0),
                               _case(OP, "T=8", {"Hb": 64, "Hd": 32, "T": 8}, {"triton": 9.0, "cuda": 1.0},
                                     checks={"cuda": False})],
               passed={(OP, "cuda"): True, (OP, "triton"): True})
    entries = _table(tmp_path)[(H200, OP, "bfloat16")]
    assert [(e[1], e[2]) for e in entries] == [(("T", 1, 1), "cuda"), (("T", 8, 8), "triton")]
    for cuda_verdict in (False, None):  # failed, or absent from the suite
        root = tmp_path / f"failed-{cuda_verdict}"
        passed = {(OP, "triton"): True} if cuda_verdict is None else {(OP, "cuda"): False, (OP, "triton"): True}
        _write_run(root, "r", [_down(1, triton=9.0, cuda=3.0)], passed=passed)
        assert [e[2] for e in _table(root)[(H200, OP, "bfloat16")]] == ["triton"]


def test_no_suite_or_nothing_passing_gives_no_entry(tmp_path):
    _write_run(tmp_path / "a", "r", [_down(1, triton=9.0, cuda=3.0)], passed=None)  # no gpu_suite.json
    _write_run(tmp_path / "b", "r", [_down(1, triton=9.0, cuda=3.0)],
               passed={(OP, "cuda"): False, (OP, "triton"): False})
    _write_run(tmp_path / "c", "r", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS, dry=True)  # dry runs ignored
    _write_run(tmp_path / "d", "gpu_check_20261201T000000Z", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS)
    for sub in "abcd":  # d: gpu_check.sh's default output directory, not a committed run
        assert _table(tmp_path / sub) == {}


def test_shape_ranges_merge_agreeing_neighbours_only(tmp_path):
    cases = [_down(1, triton=9.0, cuda=3.0), _down(4, triton=9.0, cuda=3.0), _down(8, triton=9.0, cuda=30.0),
             _down(16, triton=9.0, cuda=3.0),
             # two cases at T = 32 that disagree: no choice there, and it splits the ranges around it
             _down(32, triton=9.0, cuda=3.0), _down(32, triton=1.0, cuda=3.0), _down(64, triton=9.0, cuda=3.0),
             # another exact shape is its own group
             _down(1, Hb=128, triton=1.0, cuda=3.0)]
    _write_run(tmp_path, "r", cases, passed=ALL_PASS)
    entries = _table(tmp_path)[(H200, OP, "bfloat16")]
    got = [(dict(e[0])["Hb"], e[1], e[2]) for e in entries]
    assert got == [(128, ("T", 1, 1), "triton"), (64, ("T", 1, 4), "cuda"), (64, ("T", 8, 8), "triton"),
                   (64, ("T", 16, 16), "cuda"), (64, ("T", 64, 64), "cuda")]


def test_the_newest_run_on_a_device_supersedes_older_ones(tmp_path):
    _write_run(tmp_path, "old", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS, date="2026-12-01T00:00:00+00:00")
    _write_run(tmp_path, "new", [_down(1, triton=9.0, cuda=3.0)], passed={(OP, "cuda"): False, (OP, "triton"): True},
               date="2026-12-20T00:00:00+00:00")
    _write_run(tmp_path, "other-gpu", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS, device="NVIDIA H100 80GB HBM3")
    table = _table(tmp_path)
    assert [e[2] for e in table[(H200, OP, "bfloat16")]] == ["triton"]
    assert table[(H200, OP, "bfloat16")][0][3].startswith("new: ")
    assert [e[2] for e in table[("NVIDIA H100 80GB HBM3", OP, "bfloat16")]] == ["cuda"]


def test_a_kernel_rewritten_after_a_run_is_not_verified_by_it(tmp_path, monkeypatch):
    """make_verified.REWRITTEN: a run from before a backend's kernel was rewritten verifies nothing of the
    new kernel (the same run still verifies the other backend); a run from after it does."""
    monkeypatch.setattr(make_verified, "REWRITTEN", {(OP, "cuda"): ("2026-12-15", "a new kernel")})
    _write_run(tmp_path / "a", "before", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS,
               date="2026-12-10T00:00:00+00:00")
    assert [e[2] for e in _table(tmp_path / "a")[(H200, OP, "bfloat16")]] == ["triton"]
    _write_run(tmp_path / "b", "after", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS,
               date="2026-12-20T00:00:00+00:00")
    assert [e[2] for e in _table(tmp_path / "b")[(H200, OP, "bfloat16")]] == ["cuda"]


def _step(drafter, B, **times):
    return _case("drafter_step", f"{drafter} step B={B} ctx=8192", {"drafter": drafter, "B": B, "ctx": 8192,
                                                                     "kind": "step", "shape": []}, times)


def test_a_whole_step_has_its_own_evidence_graphed_and_eager(tmp_path):
    """The drafter_step rows decide Gemma4MTPDrafter.step's path: graph-replayed rows (triton, cuda) for the
    steps of captured rounds, eager rows (triton_eager, cuda_eager) for the others; the drafter by its widths."""
    # every op a draft step runs in the one call, the LM heads and a sampled step's softmax_sample included
    # (written out: not read from STEP_OPS)
    step_ops = ("fused_concat_down_proj", "rms_norm_q_rope", "rms_norm_linear", "rms_norm_gate_up",
                "q_only_paged_attention", "centroid_logits", "dense_lm_head", "softmax_sample")
    every = {(op, b): True for op in step_ops for b in ("cuda", "triton")}
    cases = [_step("E2B", 1, triton=171.0, cuda=203.0, triton_eager=2685.0, cuda_eager=1293.0),
             _step("E2B", 8, triton=190.0, cuda=210.0, triton_eager=2700.0, cuda_eager=1300.0),
             _step("31B", 1, triton=523.0, cuda=598.0, triton_eager=2725.0, cuda_eager=1598.0)]
    _write_run(tmp_path / "a", "r", cases, passed=every)
    table = _table(tmp_path / "a")
    graphed, eager = table[(H200, "drafter_step", "bfloat16")], table[(H200, "drafter_step_eager", "bfloat16")]
    assert [(dict(e[0]), e[1], e[2]) for e in eager] == [
        ({"Hb": 1536, "Hd": 256, "Q": 1}, ("B", 1, 8), "cuda"), ({"Hb": 5376, "Hd": 1024, "Q": 1}, ("B", 1, 1), "cuda")]
    assert [(e[1], e[2]) for e in graphed] == [(("B", 1, 8), "triton"), (("B", 1, 1), "triton")]
    assert "E2B step B=1 ctx=8192: cuda 1293.0 us, triton 2685.0 us" in eager[0][3]
    # a backend's step counts only where every op it runs passed the suite with it
    for op in step_ops:
        _write_run(tmp_path / op, "r", cases, passed={**every, (op, "cuda"): False})
        table = _table(tmp_path / op)
        assert [e[2] for e in table[(H200, "drafter_step_eager", "bfloat16")]] == ["triton", "triton"], op
    _write_run(tmp_path / "none", "r", cases, passed={(op, "cuda"): True for op in step_ops[1:]})
    assert not any(k[1].startswith("drafter_step") for k in _table(tmp_path / "none"))


def test_generated_module_is_importable_and_round_trips(tmp_path):
    _write_run(tmp_path, "r", [_down(1, triton=9.0, cuda=3.0)], passed=ALL_PASS)
    text = make_verified.generate(str(tmp_path))
    ns = {}
    exec(compile(text, "verified.py", "exec"), ns)  # noqa: S102 - our own generated table
    assert ns["EVIDENCE"] == _table(tmp_path)
    assert ns["SOURCES"][0][:2] == ("r", H200)


def test_committed_verified_py_is_what_the_committed_results_give():
    p = subprocess.run([sys.executable, "-m", "benchmarks.make_verified", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr


def test_the_first_gpu_run_verified_nothing():
    """Its GPU suite crashed (stopped at the first failure, then a segfault): no op/backend passed there."""
    src = next(s for s in verified.SOURCES if s[0] == "2026-12-01-h200")
    assert src[1] == H200 and "crashed" in src[4]
    assert not any(e[3].startswith("2026-12-01-h200") for entries in verified.EVIDENCE.values() for e in entries)


def test_bench_cases_describe_calls_with_the_shapes_the_ops_pass(monkeypatch):
    """make_verified.shape_of(case params) must be the dict the public op hands resolve() for that call,
    names and values, or the table would never match a real call."""
    for modname in run_all.MODULES:
        mod = importlib.import_module(f"benchmarks.{modname}")
        for case in mod.cases(dry=True):
            if case.op not in g.__all__:
                continue  # a unit made of several ops (a drafter step, a round): no dispatch of its own
            assert case.op in make_verified.SHAPES, f"{case.op}: no shape parameters for the evidence table"
            seen = []
            opmod = sys.modules[g.__dict__[case.op].__module__]
            real = opmod.resolve

            def spy(op, backend, device, dtype, shape=None, real=real, seen=seen):
                seen.append(shape)
                return real(op, backend, device, dtype, shape)
            monkeypatch.setattr(opmod, "resolve", spy)
            case.reference(case.make_inputs(torch.device("cpu"), torch.float32, 0))
            monkeypatch.setattr(opmod, "resolve", real)
            assert seen and seen[0] == make_verified.shape_of(case.op, case.params), case.label


# ---------------------------------------------------------------- the dispatcher following the table

ENTRY = ((("Hb", 64), ("Hd", 32)), ("T", 1, 8), "cuda", "test")


@pytest.fixture
def gpu_like(monkeypatch):
    """A CUDA device named H200 with both GPU backends available, as far as dispatch can tell."""
    monkeypatch.setattr(_dispatch, "_device_name", lambda index: H200)
    up = _dispatch.BackendStatus(True, "test")
    monkeypatch.setattr(_dispatch, "_cuda_status", lambda device=None: up)
    monkeypatch.setattr(_dispatch, "_triton_status", lambda device=None: up)
    monkeypatch.setattr(verified, "EVIDENCE", {(H200, OP, "bfloat16"): (ENTRY,)})
    return monkeypatch


def _fn(backend):
    return getattr(_dispatch._MODULES[backend], OP)


CUDA0 = torch.device("cuda", 0)


def test_lookup_matches_exact_parameters_and_the_range(gpu_like):
    look = _dispatch.evidence_backend
    assert look(H200, OP, torch.bfloat16, {"T": 1, "Hb": 64, "Hd": 32}) == "cuda"
    assert look(H200, OP, torch.bfloat16, {"T": 8, "Hb": 64, "Hd": 32}) == "cuda"  # inclusive
    assert look(H200, OP, torch.bfloat16, {"T": 9, "Hb": 64, "Hd": 32}) is None
    assert look(H200, OP, torch.bfloat16, {"T": 4, "Hb": 65, "Hd": 32}) is None
    assert look(H200, OP, torch.float16, {"T": 4, "Hb": 64, "Hd": 32}) is None
    assert look("NVIDIA A100-SXM4-80GB", OP, torch.bfloat16, {"T": 4, "Hb": 64, "Hd": 32}) is None
    assert look(H200, "tree_verify", torch.bfloat16, {"B": 1, "N": 5, "V": 9, "sampling": False,
                                                      "draft_probs": False}) is None


def test_auto_follows_the_evidence_on_cuda_and_keeps_torch_on_cpu(gpu_like):
    shape = {"T": 4, "Hb": 64, "Hd": 32}
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, shape) is _fn("cuda")
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, dict(shape, T=9)) is _fn("triton")  # no entry
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.float16, shape) is _fn("triton")
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, None) is _fn("triton")
    assert _dispatch.resolve(OP, "auto", torch.device("cpu"), torch.bfloat16, shape) is _fn("torch")
    gpu_like.setattr(_dispatch, "_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, shape) is _fn("triton")


def test_auto_goes_to_triton_when_the_chosen_cuda_backend_is_not_built_here(gpu_like):
    gpu_like.setattr(_dispatch, "_cuda_status", lambda device=None: _dispatch.BackendStatus(False, "not built"))
    assert _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, {"T": 4, "Hb": 64, "Hd": 32}) is _fn("triton")


def test_explicit_backends_ignore_the_evidence_and_never_fall_back(gpu_like):
    shape = {"T": 4, "Hb": 64, "Hd": 32}
    assert _dispatch.resolve(OP, "triton", CUDA0, torch.bfloat16, shape) is _fn("triton")
    assert _dispatch.resolve(OP, "torch", CUDA0, torch.bfloat16, shape) is _fn("torch")
    gpu_like.setattr(_dispatch, "_cuda_status", lambda device=None: _dispatch.BackendStatus(False, "not built"))
    with pytest.raises(g.BackendUnavailableError, match="not built"):
        _dispatch.resolve(OP, "cuda", CUDA0, torch.bfloat16, shape)


STEP = {"Hb": 1536, "Hd": 256, "Q": 1}


def test_a_step_is_one_call_where_its_evidence_names_cuda(gpu_like):
    gpu_like.setattr(verified, "EVIDENCE", {
        (H200, "drafter_step_eager", "bfloat16"): ((tuple(STEP.items()), ("B", 1, 8), "cuda", "test"),),
        (H200, "drafter_step", "bfloat16"): ((tuple(STEP.items()), ("B", 1, 8), "triton", "test"),)})
    one = _dispatch.step_in_one_call
    assert one(CUDA0, torch.bfloat16, dict(STEP, B=8), graphed=False)
    assert not one(CUDA0, torch.bfloat16, dict(STEP, B=8), graphed=True)  # replayed, triton was faster
    assert not one(CUDA0, torch.bfloat16, dict(STEP, B=9), graphed=False)  # no entry: the ops
    assert not one(CUDA0, torch.bfloat16, dict(STEP, Q=2, B=1), graphed=False)
    assert not one(CUDA0, torch.float16, dict(STEP, B=1), graphed=False)
    for device in (torch.device("cpu"), torch.device("meta")):
        assert not one(device, torch.bfloat16, dict(STEP, B=1), graphed=False)
    gpu_like.setattr(_dispatch, "_cuda_status", lambda device=None: _dispatch.BackendStatus(False, "not built"))
    assert not one(CUDA0, torch.bfloat16, dict(STEP, B=1), graphed=False)


def test_a_step_asks_with_the_shape_the_bench_rows_describe(monkeypatch):
    """The dict Gemma4MTPDrafter.step hands step_in_one_call for a benchmark step is make_verified.shape_of of
    that step's row (names and values), eager outside a graphed round and graphed inside one."""
    from benchmarks import bench_drafter_step
    from gemma4_mtp import drafter as drafter_module
    from gemma4_mtp.drafter import random_drafter, synthetic_context

    seen = []

    class Asked(Exception):
        pass

    def spy(device, dtype, shape, *, graphed):
        seen.append((shape, graphed, dtype))
        raise Asked  # the step would go on through the ops (torch's reads a meta tensor cannot answer)
    monkeypatch.setattr(drafter_module, "step_in_one_call", spy)
    steps = {(c.params["drafter"], c.params["B"]): c for c in bench_drafter_step.cases(dry=False)
             if c.op == "drafter_step"}
    assert {d for d, _ in steps} == {"E2B", "E4B", "26B-A4B", "31B"}
    for case in (steps["E2B", 1], steps["31B", 8], steps["E4B", 32], steps["26B-A4B", 1]):
        p = case.params
        d = random_drafter(p["drafter"], device="meta", backend="auto")
        ctx = synthetic_context(d, p["B"], 64, device="meta")
        tokens = torch.empty(p["B"], 1, dtype=torch.int64, device="meta")
        hidden = torch.empty(p["B"], 1, d.config.backbone_hidden_size, dtype=torch.bfloat16, device="meta")
        for graphed in (False, True):
            with pytest.raises(Asked), (d.graphed_steps() if graphed else contextlib.nullcontext()):
                d.step(ctx, tokens, hidden)
            shape, was_graphed, dtype = seen.pop()
            for op in ("drafter_step_eager", "drafter_step"):
                assert shape == make_verified.shape_of(op, p), case.label
            assert was_graphed == graphed and dtype == torch.bfloat16


def test_auto_dispatch_traces_in_fullgraph_with_dynamic_shapes(gpu_like):
    """The whole auto branch (device name, evidence lookup, range comparison on a symbolic size) is
    traceable: no import, no tensor read; the choice lands in the graph as a constant under guards."""
    cuda_fn = _fn("cuda")

    def f(x):
        impl = _dispatch.resolve(OP, "auto", CUDA0, torch.bfloat16, {"T": x.shape[0], "Hb": 64, "Hd": 32})
        return x + (1.0 if impl is cuda_fn else 2.0)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    for T in (2, 5, 8, 9, 30, 3):
        x = torch.zeros(T)
        assert torch.equal(cf(x), f(x)), T
        assert float(cf(x)[0]) == (1.0 if T <= 8 else 2.0)


def down_proj_args(T=3, Hb=64, Hd=32, V=10):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (T,), generator=gen), torch.randn(V, Hb, generator=gen),
            torch.randn(T, Hb, generator=gen), torch.randn(Hd, 2 * Hb, generator=gen) / 8)


@pytest.mark.parametrize("dynamic", [False, True])
def test_public_op_compiles_in_fullgraph_with_the_torch_backend(dynamic):
    args = down_proj_args()

    def step(*a):
        return g.fused_concat_down_proj(*a, embed_scale=1.5, backend="torch") + 1

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager", dynamic=dynamic)(*args)
    torch.testing.assert_close(got, step(*args))


def test_public_op_with_auto_on_cpu_compiles_in_fullgraph():
    args = down_proj_args()

    def step(*a):
        return g.fused_concat_down_proj(*a, embed_scale=1.5) + 1

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(got, step(*args))


# ---------------------------------------------------------------- gpu_suite.json from a per-file run

def _junit(path, cases, seconds=None):
    body = "".join(
        f'<testcase classname="tests.x" name="{n}">' + {"passed": "", "failed": "<failure message='m'/>",
                                                         "error": "<error message='m'/>",
                                                         "skipped": "<skipped message='s'/>"}[o] + "</testcase>"
        for n, o in cases)
    time = "" if seconds is None else f' time="{seconds}"'
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest"{time}>{body}</testsuite></testsuites>')


def test_gpu_suite_verdict_per_op_and_backend(tmp_path):
    d = tmp_path
    _junit(d / "test_q_only_attention_cuda.xml", [("test_a", "passed"), ("test_b", "passed"), ("test_c", "skipped")])
    (d / "test_q_only_attention_cuda.rc").write_text("0\n")
    _junit(d / "test_q_only_attention_triton.xml", [("test_a", "passed"), ("test_b", "failed")])
    (d / "test_q_only_attention_triton.rc").write_text("1\n")
    (d / "test_tree_verify_cuda.rc").write_text("139\n")  # segfault: no XML
    _junit(d / "test_centroid_logits_triton.xml", [("test_a", "skipped")])
    (d / "test_centroid_logits_triton.rc").write_text("0\n")
    _junit(d / "test_fused_concat_down_proj_triton.xml", [("test_a", "passed")])
    (d / "test_fused_concat_down_proj_triton.rc").write_text("0\n")
    # a cross-op file of one backend: each test counts for the op it names, others for every cuda op
    _junit(d / "test_cuda_review.xml", [("test_attention_misaligned", "passed"), ("test_concat_bad_ids", "failed"),
                                        ("test_all_ops_refuse_cpu", "passed")])
    (d / "test_cuda_review.rc").write_text("1\n")
    (d / "test_triton_aot.rc").write_text("5\n")  # no GPU test in it: counts for nothing
    # a group's file that crashed counts against the group's ops only
    _junit(d / "test_fused_glue_triton.xml", [("test_prologues[rms_norm_q_rope-bf16]", "passed")])
    (d / "test_fused_glue_triton.rc").write_text("0\n")
    (d / "test_fused_glue_cuda.rc").write_text("139\n")
    s = gpu_suite.convert(str(d))
    ops = s["ops"]
    assert ops["q_only_paged_attention"]["cuda"]["passed"] is True
    assert ops["q_only_paged_attention"]["cuda"]["tests"] == 5  # 3 own + named + unnamed from the review file
    assert ops["q_only_paged_attention"]["triton"]["passed"] is False
    assert "1 failed" in ops["q_only_paged_attention"]["triton"]["why"]
    assert ops["tree_verify"]["cuda"]["passed"] is False and "crashed" in ops["tree_verify"]["cuda"]["why"]
    assert ops["centroid_logits"]["triton"]["passed"] is False and "no test ran" in ops["centroid_logits"]["triton"]["why"]
    assert ops["fused_concat_down_proj"]["triton"]["passed"] is True
    assert ops["fused_concat_down_proj"]["cuda"]["passed"] is False  # the review file's concat test failed
    assert ops["centroid_logits"]["cuda"]["passed"] is True  # only the unnamed review test, which passed
    assert s["complete"] is False and s["files"]["test_tree_verify_cuda"]["status"] == "crashed"
    assert ops["rms_norm_q_rope"]["triton"]["passed"] is True and ops["rms_norm_linear"]["triton"]["tests"] == 0
    assert all("crashed" in ops[op]["cuda"]["why"] for op in gpu_suite.GROUPS["fused_glue"])
    assert "test_fused_glue_cuda" not in ops["centroid_logits"]["cuda"]["files"]
    assert s["files"]["test_triton_aot"]["status"] == "no tests"
    # the CLI writes the same file
    out = tmp_path / "gpu_suite.json"
    assert gpu_suite.main([str(d), "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(s))


def test_gpu_suite_timeouts_count_against_the_file_ops(tmp_path):
    _junit(tmp_path / "test_tree_verify_triton.xml", [("test_a", "passed")])
    (tmp_path / "test_tree_verify_triton.rc").write_text("124\n")
    s = gpu_suite.convert(str(tmp_path))
    assert s["ops"]["tree_verify"]["triton"]["passed"] is False
    assert "timed out" in s["ops"]["tree_verify"]["triton"]["why"]


def test_gpu_suite_files_start_longest_first_by_the_newest_committed_times(tmp_path):
    """gpu_check.sh starts the suite's files in `gpu_suite.order`: files the newest committed run did not
    time first, then by that run's time, longest first; its gpu_suite.json holds each file's time (pytest's,
    from the XML), older runs only gpu_suite.txt's lines."""
    pytest_dir = tmp_path / "pytest"
    pytest_dir.mkdir()
    _junit(pytest_dir / "test_tree_verify_cuda.xml", [("test_a", "passed")], seconds=12.5)
    (pytest_dir / "test_tree_verify_cuda.rc").write_text("0\n")
    (pytest_dir / "test_tree_verify_triton.rc").write_text("139\n")  # died: no XML, no time
    files = gpu_suite.convert(str(pytest_dir))["files"]
    assert files["test_tree_verify_cuda"]["seconds"] == 12.5 and files["test_tree_verify_triton"]["seconds"] is None

    results = tmp_path / "results"  # committed runs: each with its results.json (make_verified.load_runs)
    old = _write_run(results, "2026-12-04-h200", [], passed=None, date="2026-12-04T00:00:00+00:00") / "raw"
    old.mkdir()
    (old / "gpu_suite.txt").write_text(
        "test_a_cuda ok: 43 passed, 14 warnings in 28.34s\n"
        "test_b_cuda FAILED rc=1: 3 failed, 27 passed in 63.94s (0:01:03)\n"
        "test_c_triton not run (suite time box spent)\n")
    paths = ["tests/test_a_cuda.py", "tests/test_b_cuda.py", "tests/test_c_triton.py", "tests/test_new_cuda.py"]
    assert gpu_suite.order(paths, str(results)) == ["tests/test_c_triton.py", "tests/test_new_cuda.py",
                                                    "tests/test_b_cuda.py", "tests/test_a_cuda.py"]
    # a newer run's gpu_suite.json times win; gpu_check.sh's uncommitted output directories do not count
    new = _write_run(results, "2026-12-20-h200", [], passed=None, date="2026-12-20T00:00:00+00:00")
    (new / "gpu_suite.json").write_text(json.dumps({"files": {"test_a_cuda": {"seconds": 90.0},
                                                              "test_b_cuda": {"seconds": 10.0},
                                                              "test_c_triton": {"seconds": None}}}))
    uncommitted = _write_run(results, "gpu_check_20261230T000000Z", [], passed=None,
                             date="2026-12-30T00:00:00+00:00")
    (uncommitted / "gpu_suite.json").write_text(json.dumps({"files": {"test_b_cuda": {"seconds": 999.0}}}))
    assert gpu_suite.order(paths, str(results)) == ["tests/test_c_triton.py", "tests/test_new_cuda.py",
                                                    "tests/test_a_cuda.py", "tests/test_b_cuda.py"]
    assert gpu_suite.main(["--order", "--results", str(results), *paths]) == 0
    assert gpu_suite.order(paths, str(tmp_path / "none")) == paths


def test_gpu_suite_order_of_the_committed_runs_covers_every_gpu_file(capsys):
    """The CLI gpu_check.sh calls, on this checkout: every GPU test file (those its grep finds; the pattern
    is escaped here, or this file would be one), each once."""
    import glob
    import re
    files = sorted(p for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
                   if re.search(r"mark\.gpu", open(p).read()))
    assert gpu_suite.main(["--order", *files]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == files
    assert printed.index(os.path.join(ROOT, "tests", "test_dense_lm_head_cuda.py")) < printed.index(
        os.path.join(ROOT, "tests", "test_transfer.py"))  # 63.9 s and 6.1 s on 2026-12-04
