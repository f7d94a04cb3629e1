"""benchmarks.ncu_step's reading of Nsight Compute's CSV (the profiling itself runs in gpu_check.sh): both
layouts ncu prints, units, thousands separators, n/a, the stall ranking, and what it says without a GPU."""
import pytest

from benchmarks import ncu_step

# ncu's raw page as --log-file receives it: its own ==PROF== lines, a header, a units row, a row per kernel
RAW = "\n".join([
    '==PROF== Connected to process 4242 (/usr/bin/python3.12)',
    '==PROF== Profiling "_q_rope_kernel" - 0: 0%....50%....100% - 12 passes',
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum",'
    '"dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum","launch__grid_size",'
    '"launch__registers_per_thread","launch__waves_per_multiprocessor","lts__t_sector_hit_rate.pct",'
    '"sm__warps_active.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_membar_per_issue_active.ratio"',
    '"","","","","","","","","","","","Mbyte","Kbyte","%","usecond","","register/thread","","%","%","ratio",'
    '"ratio","ratio"',
    '"1","4242","python3.12","h200","void gemma4_mtp::attention::tc::kernel<__nv_bfloat16, 512, 1>'
    '(gemma4_mtp::AttentionParams, int)","1","7","(256, 1, 1)","(4, 33, 1)","0","9.0","1,068.20","520.00","75.0",'
    '"2,500.00","132","168","1.00","0.5","12.0","3.0","40.5","0"',
    '"0","4242","python3.12","h200","_q_rope_kernel","1","7","(128, 1, 1)","(256, 1, 1)","0","9.0","33.55",'
    '"4.10","41.2","19.84","256","80","0.97","2.5","23.1","0.8","14.2","n/a"',
    '==PROF== Report: done',
])

# the details page: a row per kernel and metric, each with its own unit
DETAILS = "\n".join([
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
    '"3","1","python","h","_mlp_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","GPU Speed Of Light Throughput",'
    '"gpu__time_duration.sum","nsecond","7,250.00"',
    '"3","1","python","h","_mlp_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics",'
    '"dram__bytes_read.sum","Kbyte","500.00"',
    '"5","1","python","h","_head","1","7","(256, 1, 1)","(128, 1, 1)","0","9.0","GPU Speed Of Light Throughput",'
    '"gpu__time_duration.sum","msecond","0.0125"',
    '"5","1","python","h","_head","1","7","(256, 1, 1)","(128, 1, 1)","0","9.0","Warp State Statistics",'
    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","ratio","2.50"',
])


def test_raw_page_kernels_in_id_order_with_units_and_separators():
    k0, k1 = ncu_step.summarize(RAW)
    assert (k0["id"], k0["name"], k1["id"], k1["name"]) == (0, "_q_rope_kernel", 1,
                                                             "gemma4_mtp::attention::tc::kernel")
    assert k0["us"] == pytest.approx(19.84)
    assert k0["dram_read_mb"] == pytest.approx(33.55) and k0["dram_write_mb"] == pytest.approx(0.0041)
    assert k0["dram_tbs"] == pytest.approx((33.55 + 0.0041) / 19.84)  # MB per µs
    assert (k0["dram_pct"], k0["l2_hit_pct"], k0["occupancy_pct"]) == (41.2, 2.5, 23.1)
    assert (k0["grid"], k0["registers"], k0["waves"]) == (256, 80, 0.97)
    assert k0["sm_pct"] is None and k0["cycles_per_issue"] is None  # not in this CSV
    # n/a and zero are not stalls; the rest largest first
    assert list(k0["stalls"].items()) == [("long_scoreboard", 14.2), ("barrier", 0.8)]
    assert list(k1["stalls"]) == ["long_scoreboard", "barrier"]
    assert k1["us"] == pytest.approx(2500.0) and k1["dram_read_mb"] == pytest.approx(1068.2)


def test_details_page_units_per_row():
    mlp, head = ncu_step.summarize(DETAILS)
    assert (mlp["name"], mlp["us"], mlp["dram_read_mb"]) == ("_mlp_kernel", pytest.approx(7.25), pytest.approx(0.5))
    assert mlp["dram_tbs"] == pytest.approx(0.5 / 7.25)
    assert (head["id"], head["us"], head["dram_read_mb"], head["dram_tbs"]) == (5, pytest.approx(12.5), None, None)
    assert head["stalls"] == {"wait": 2.5}


def test_a_unit_it_does_not_know_gives_no_number():
    text = RAW.replace('"usecond"', '"furlong"')
    k0 = ncu_step.summarize(text)[0]
    assert k0["us"] is None and k0["dram_tbs"] is None
    assert k0["dram_read_mb"] == pytest.approx(33.55)  # the other columns are still read


def test_output_without_a_header_is_refused():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_step.summarize("==ERROR== ERR_NVGPUCTRPERM - no permission to access the GPU's performance counters")


def test_table_lines():
    results = {"backend": "triton", "drafters": {
        "31B": {"error": "timed out after 30 s (ncu writes its results when the program ends)"},
        "E2B": {"kernels": ncu_step.summarize(RAW)}}}
    lines = ncu_step.table(results).splitlines()
    assert lines[0] == "31B: timed out after 30 s (ncu writes its results when the program ends)"
    assert lines[1].startswith("E2B B=1 ctx=8192 triton: 2 kernels, 2519.8 µs one by one")
    q_rope = next(ln for ln in lines if "_q_rope_kernel" in ln)
    assert "19.84" in q_rope and "1.69" in q_rope and "long_scoreboard 14.2, barrier 0.8" in q_rope
    assert q_rope.split()[-5] == "80"  # registers, before the stalls


def test_ncu_profiles_only_the_profiler_range_of_the_drafter_asked():
    cmd = ncu_step.ncu_command("ncu", "E2B", "triton", "/o/ncu_E2B.csv")
    assert cmd[cmd.index("--profile-from-start") + 1] == "off"
    assert cmd[cmd.index("--log-file") + 1] == "/o/ncu_E2B.csv"
    assert cmd[cmd.index("--page") + 1] == "raw" and "--csv" in cmd
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu_step.SECTIONS)
    assert cmd[-6:] == ["benchmarks.ncu_step", "run", "--drafter", "E2B", "--backend", "triton"]


def test_without_a_gpu_it_says_so(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert ncu_step.main(["--out", str(tmp_path / "n.json")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()


# An executable standing in for ncu (the tool is not on CPU machines): it does what the mode says with the
# command line ncu_step gives it, so that the process handling around the real tool is what runs.
FAKE_NCU = '''#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
log = args[args.index("--log-file") + 1]
mode = os.environ["FAKE_NCU_MODE"]
if mode == "log" or (mode == "hang-31B" and "31B" not in args):
    open(log, "w").write(os.environ["FAKE_NCU_CSV"])
    print("program output")
elif mode == "stdout":
    open(log, "w").write("==PROF== Disconnected\\n")
    print(os.environ["FAKE_NCU_CSV"])
elif mode == "fail":
    print("==ERROR== unknown section WarpStateStatz")
    sys.exit(1)
else:  # hang, with a child of its own, as ncu and the program it runs
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(log + ".pid", "w").write(str(child.pid))
    time.sleep(60)
'''


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    import stat
    import sys
    path = tmp_path / "ncu"
    path.write_text(FAKE_NCU.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_NCU_CSV", RAW)
    return str(path)


@pytest.mark.parametrize("mode", ["log", "stdout"])
def test_profile_reads_the_csv_where_ncu_wrote_it(fake_ncu, tmp_path, monkeypatch, mode):
    monkeypatch.setenv("FAKE_NCU_MODE", mode)
    csv_path = str(tmp_path / "ncu_E2B.csv")
    (tmp_path / "ncu_E2B.csv").write_text(DETAILS)  # a previous run's: never read
    r = ncu_step._profile(fake_ncu, "E2B", "triton", csv_path, timeout=60)
    assert r["returncode"] == 0 and [k["name"] for k in r["kernels"]] == ["_q_rope_kernel",
                                                                         "gemma4_mtp::attention::tc::kernel"]
    assert (tmp_path / "ncu_E2B.out").exists()


def test_profile_reports_a_failing_ncu(fake_ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "fail")
    r = ncu_step._profile(fake_ncu, "31B", "triton", str(tmp_path / "ncu_31B.csv"), timeout=60)
    assert r["error"].startswith("ncu exited 1") and "unknown section WarpStateStatz" in r["error"]


def test_profile_time_box_kills_ncu_and_its_program(fake_ncu, tmp_path, monkeypatch):
    import os
    import time
    monkeypatch.setenv("FAKE_NCU_MODE", "hang")
    csv_path = str(tmp_path / "ncu_31B.csv")
    t0 = time.monotonic()
    r = ncu_step._profile(fake_ncu, "31B", "triton", csv_path, timeout=3)
    assert time.monotonic() - t0 < 20 and r["error"].startswith("timed out after 3 s")
    child = int(open(csv_path + ".pid").read())
    for _ in range(50):  # the kill reaches the grandchild through the process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the program ncu ran outlived the time box")


def test_each_drafter_gets_its_share_and_the_json_follows(fake_ncu, tmp_path, monkeypatch):
    import json
    import time
    out = tmp_path / "ncu_step.json"
    results = {"backend": "triton", "drafters": {}}
    monkeypatch.setenv("FAKE_NCU_MODE", "hang-31B")  # 31B hangs and takes its share; E2B and E4B write the log
    monkeypatch.setattr(ncu_step, "MIN_BOX_S", 2)
    t0 = time.monotonic()
    assert ncu_step.profile_all(results, fake_ncu, ["31B", "E2B", "E4B"], str(out), budget=9) == 1
    assert time.monotonic() - t0 < 30
    saved = json.loads(out.read_text())["drafters"]
    assert saved == results["drafters"] and list(saved) == ["31B", "E2B", "E4B"]
    assert saved["31B"]["error"].startswith("timed out after 3 s")  # a third of the budget
    for name in ("E2B", "E4B"):
        assert saved[name]["returncode"] == 0 and (tmp_path / f"ncu_{name}.csv").exists()
        assert [k["name"] for k in saved[name]["kernels"]] == ["_q_rope_kernel", "gemma4_mtp::attention::tc::kernel"]
    # too little left for a share: not run, said so
    results = {"backend": "triton", "drafters": {}}
    assert ncu_step.profile_all(results, fake_ncu, ["E2B", "E4B"], str(out), budget=3) == 1
    assert results["drafters"]["E2B"]["error"].startswith("not run: a share of 1 s")  # 1.5 s, less the time passed
