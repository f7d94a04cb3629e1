"""benchmarks/checklist.py: its predictions name cases the benchmarks run, its verdicts of a hand-written
run, and run_all timing its cases before any other."""
import importlib
import json
import sys
import types

import pytest

from benchmarks import checklist, run_all


def test_every_prediction_names_a_case_and_baseline_the_benchmarks_run(tmp_path, monkeypatch):
    # as gpu_check.sh runs them: after the sweep, with its tuned file (bench_drafter_step's `triton_tuned`)
    tuned = tmp_path / "tuned.json"
    tuned.write_text(json.dumps({"schema": 1, "device": "NVIDIA H200", "entries": [
        {"op": "rms_norm_linear", "shape": {"T": 1, "N": 1024, "K": 16384}, "config": {"num_stages": 4}}]}))
    monkeypatch.setenv("GEMMA4_MTP_BENCH_TUNED_CONFIGS", str(tuned))
    baselines = {}
    for m in run_all.MODULES:
        for c in importlib.import_module(f"benchmarks.{m}").cases(False):
            baselines[(c.op, c.label)] = set(c.baselines)
    for p in checklist.PREDICTIONS:
        assert p.baseline in baselines.get((p.op, p.case), ()), p
        if p.minus:
            assert p.minus[1] in baselines.get((p.op, p.minus[0]), ()), p
        assert p.lo <= p.hi, p
    assert len(checklist.cases()) == len(set(checklist.cases()))


def _case(op, label, **times_us):
    return {"op": op, "case": label, "results": [
        {"baseline": b, "status": "ok" if t is not None else "error", "time_s": None if t is None else t * 1e-6}
        for b, t in times_us.items()]}


def test_verdicts_of_a_hand_written_run():
    step31 = "31B step B=1 ctx=8192"
    results = {"cases": [
        _case("drafter_step", "E2B step B=1 ctx=8192", triton=150.0, triton_pdl_at_exit=None),
        _case("drafter_step", step31, triton=500.0, triton_no_prefetch=510.0, triton_pdl_at_exit=470.0),
        _case("rms_norm_q_rope", "E2B q_proj full T=1", triton=6.0),
        _case("draft_round", "E2B sampled chain round k=4 T=0.8 B=1 ctx=8192", triton=740.0),
    ]}
    got = {(r["what"]): (r["measured"], r["verdict"]) for r in checklist.verdicts(results)}
    assert got["E2B step"] == (pytest.approx(150.0), "in range")
    assert got["31B step"] == (pytest.approx(500.0), "above")
    assert got["31B step without the weight prefetch, less with it"] == (pytest.approx(10.0), "in range")
    assert got["31B step, PDL triggered at each kernel's exit, less at its wait"] == (pytest.approx(-30.0), "below")
    assert got["E2B q_rope T=1"] == (pytest.approx(6.0), "below")
    # a failed baseline, a missing case, a difference whose other side did not run: not measured
    assert got["E2B step, PDL triggered at each kernel's exit, less at its wait"] == (None, "not measured")
    assert got["E2B gate_up T=1"] == (None, "not measured")
    assert got["E2B sampled chain round less the greedy chain round"] == (None, "not measured")
    text = checklist.table(results)
    assert text.count("\n") == len(checklist.PREDICTIONS) + 1 and "| 150.0 | in range |" in text


def test_a_run_on_another_device_is_named_before_the_verdicts():
    cases = [_case("drafter_step", "E2B step B=1 ctx=8192", triton=171.0)]
    h200 = checklist.table({"env": {"device": "NVIDIA H200"}, "cases": cases})
    assert h200.startswith("| prediction |")
    h100 = checklist.table({"env": {"device": "NVIDIA H100 80GB HBM3"}, "device_peaks": {"copy_bytes_per_s": 3.0e12},
                            "cases": cases})
    first, blank, head = h100.splitlines()[:3]
    assert "this run is on NVIDIA H100 80GB HBM3; its copy bandwidth 3.00 TB/s, 1.40x slower" in first
    assert (blank, head.startswith("| prediction |")) == ("", True)
    assert "| 171.0 | above |" in h100  # not rescaled
    unknown = checklist.table({"env": {"device": "NVIDIA A100-SXM4-80GB"}, "cases": cases}).splitlines()[0]
    assert "this run is on NVIDIA A100-SXM4-80GB:" in unknown and "TB/s," not in unknown


def test_the_command_prints_the_verdicts(tmp_path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"cases": [_case("drafter_step", "E2B step B=1 ctx=8192", triton=171.0)]}))
    assert checklist.main([str(path)]) == 0
    assert "| 171.0 | above |" in capsys.readouterr().out
    assert checklist.main([]) == 0 and "| 124 to 152 |" in capsys.readouterr().out


def test_ordered_puts_the_checklist_cases_first():
    cases_of = {m: importlib.import_module(f"benchmarks.{m}").cases(False) for m in run_all.MODULES}
    order = run_all.ordered(cases_of, checklist.cases())
    keys = [(cases_of[m][i].op, cases_of[m][i].label) for m, i in order]
    assert keys[:len(checklist.cases())] == checklist.cases()
    assert sorted(keys) == sorted((c.op, c.label) for cs in cases_of.values() for c in cs)


def test_run_all_times_the_checklist_cases_before_the_others(tmp_path, monkeypatch):
    from test_bench_dry import _toy_cases

    fake = types.ModuleType("benchmarks.bench_toy")
    fake.cases = lambda dry: _toy_cases()
    monkeypatch.setitem(sys.modules, "benchmarks.bench_toy", fake)
    monkeypatch.setattr(run_all, "MODULES", ("bench_toy",))
    op = _toy_cases()[0].op
    monkeypatch.setattr(checklist, "cases", lambda: [(op, "second")])
    out = tmp_path / "results.json"
    assert run_all.main(["--dry-run", "--out", str(out)]) == 0
    assert [c["case"] for c in json.loads(out.read_text())["cases"]] == ["second", "first"]


def test_every_stage_prediction_names_rows_the_benchmark_prints():
    """Each stage-boundary prediction reads rows stage_boundary.cu prints: its section, its keys, and its
    string values (modes, stream sources, layer kinds) among the program's own strings; a wide GEMV's shape and an
    attention row's layer are the names bench_stage_boundary gives the drafters' glue GEMVs and attention layers it
    passes the program."""
    import re
    from pathlib import Path

    from benchmarks import bench_stage_boundary as bsb

    source = (Path(checklist.__file__).parent / "cuda" / "stage_boundary.cu").read_text()
    strings = set(re.findall(r'"((?:[^"\\]|\\.)*)"', source))
    wide = {name for d in bsb.WIDE_DRAFTERS for name in bsb.glue_gemvs(d).values()}
    for p in checklist.STAGE_PREDICTIONS:
        assert f'\\"{p.section}\\": [' in source or p.section == "results", p
        for key, value in p.match:
            if (p.section, key) == ("wide_gemv", "shape"):
                assert value in wide, (p, value)
                continue
            if (p.section, key) == ("attention", "layer"):
                assert value in {layer[0] for layer in bsb.attention_layers()}, (p, value)
                continue
            assert f'\\"{key}\\": ' in source, (p, key)
            if isinstance(value, str):
                assert value in strings, (p, value)
        assert p.field == "per_layer" or f'\\"{p.field}\\": ' in source, p
        assert p.lo <= p.hi, p
    assert len({(p.section, p.match, p.field) for p in checklist.STAGE_PREDICTIONS}) == len(checklist.STAGE_PREDICTIONS)


def test_stage_verdicts_of_a_hand_written_run(capsys, tmp_path):
    sb = {"results": [{"mode": "cluster_push", "programs": 16, "ok": True, "us_per_stage": 0.5},
                      {"mode": "cluster_push", "programs": 2, "ok": False, "us_per_stage": 0.4}],
          "stream": [{"source": "dram", "programs": 132, "ok": True, "tb_per_s": 3.0}],
          "gemv": [{"layer": "full", "programs": 16, "layers": 1, "ok": True, "us": 8.0},
                   {"layer": "full", "programs": 16, "layers": 4, "ok": True, "us": 20.0},
                   {"layer": "sliding", "programs": 16, "layers": 1, "ok": True, "us": 9.0},
                   {"layer": "sliding", "programs": 16, "layers": 4, "error": "launch failed"},
                   {"layer": "step", "programs": 16, "stages": 21, "ok": True, "us": 40.0}],
          "wide_gemv": [{"shape": "31B o_proj full", "programs": 128, "ok": True, "us": 13.0},
                        {"shape": "31B o_proj full", "programs": 64, "ok": True, "us": 11.0}],
          "attention": [{"ctx": 8192, "programs": 128, "ok": True, "us": 9.0},
                        {"ctx": 32768, "programs": 128, "ok": False, "us": 21.0},
                        {"heads": 8, "dim": 512, "kv_heads": 4, "ctx": 8192, "programs": 128, "ok": True, "us": 26.0},
                        {"heads": 2, "dim": 256, "kv_heads": 16, "ctx": 1024, "programs": 128, "ok": True, "us": 12.0},
                        {"heads": 8, "dim": 512, "kv_heads": 4, "ctx": 8192, "kernel": "mma", "programs": 128,
                         "ok": True, "us": 21.0}]}
    by_what = {p.what: p for p in checklist.STAGE_PREDICTIONS}
    value = lambda what: checklist.stage_value(sb, by_what[what])  # noqa: E731
    assert value("`cluster_push`, 16 programs, a stage") == 0.5
    assert value("`cluster_push`, 2 programs, a stage") is None  # its check failed: no verdict on it
    assert value("`stream` DRAM, 132 programs") == 3.0
    assert value("E2B full layer's GEMVs in one cluster of 16, a layer") == 4.0  # (20 - 8) / 3
    assert value("E2B sliding layer in one cluster of 16, a layer") is None  # its 4-layer row failed
    assert value("E2B step in one cluster of 16 (less the full attention and the head's selection), one replay") == 40.0
    assert value("31B o_proj full, 128 programs") == 13.0
    assert value("E2B full attention, 8K keys, 128 programs") == 9.0
    assert value("E2B full attention, 32K keys, 128 programs") is None  # its check failed
    assert value("31B full attention, 8K keys, 128 programs") == 26.0  # not the E2B row of the same keys
    assert value("31B full attention, 8K keys, 64 programs") is None
    assert value("31B sliding attention, its 1024-key window, 128 programs") == 12.0
    assert value("31B full attention, 8K keys, 128 programs on tensor cores") == 21.0
    assert value("E2B full attention, 8K keys, 128 programs on tensor cores") is None
    path = tmp_path / "stage_boundary.json"
    path.write_text(json.dumps(sb))
    assert checklist.main(["--stage-boundary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| `cluster_push`, 16 programs, a stage | 0.35-0.6 µs |" in out and "| 0.50 | in range |" in out
    assert "| 3.00 | below |" in out and "| 13.00 | above |" in out and "| 4.00 | in range |" in out
    assert "| 40.00 | above |" in out  # the step in one cluster: 20-37 µs predicted
