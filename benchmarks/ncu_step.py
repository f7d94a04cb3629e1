"""Hardware counters of every kernel of one drafter step, from Nsight Compute (`ncu`), on the GPU.

Issue 11's steps are made of ~20 kernels of ~5 µs each (E2B, latency chains) and of GEMVs that streamed
their weights at 30-50% of copy bandwidth (31B) on 2026-12-04. The op benchmarks time the kernels,
`profile_step` places them in a replayed graph; neither says why a kernel takes what it takes, and every
explanation written since (bytes in flight, serial L2 round trips, waves, elections) is a model. This
runs one eager step (`Gemma4MTPDrafter.step` + `top_tokens(last, 1)`, B = 1, 8K, the real shapes, random
weights: `bench_drafter_step`'s inputs) of each drafter under `ncu` and keeps, per kernel: its duration
alone, DRAM bytes and throughput against the peak, the L2 hit rate, SM throughput, achieved occupancy,
waves per SM, registers, warp cycles per issued instruction and the warp stall reasons ranked
(WarpStateStats: the cycles per issued instruction that warps spend stalled on each reason).

    python -m benchmarks.ncu_step --out ncu_step.json [--drafters 31B,E2B] [--backend triton] [--time-budget 60]
    python -m benchmarks.ncu_step --table ncu_step.json

One ncu process per drafter, each in its own time box (a box that runs out loses that drafter only: ncu
writes its results when the program ends). The program (`python -m benchmarks.ncu_step run`) makes two
steps unprofiled (the first compiles, the second takes the checked-once fast path the decode loop takes),
then the third between cudaProfilerStart / cudaProfilerStop, the only kernels ncu profiles
(`--profile-from-start off`). ncu's raw page (CSV, every metric the sections collect) is kept beside the
JSON as ncu_<drafter>.csv, the program's own output as ncu_<drafter>.out.

What the numbers are: ncu runs each kernel alone, replayed once per counter pass, with L2 flushed before
each pass (its default cache control) and the GPU's own clocks (`--clock-control none`, as the guide of
the device says). So every kernel reads its weights from DRAM, as a 31B step does (its weights exceed
the L2) and an E2B step replayed in a graph does not (its ~15 MB stay in the 50 MB L2): E2B durations
here are upper bounds of the graph's, and no kernel overlaps the next (programmatic dependent launch
hides nothing here). The prediction is in benchmarks/README.md ("Hardware counters per kernel").
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

# ncu sections and extra metrics (sm_80 / sm_90 names). A section ncu does not know fails the whole run,
# so only the long-standing ones.
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats")
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct")
B, CTX = 1, 8192
MIN_BOX_S = 10  # a drafter's ncu run is not started with less time than this left

# The summary's fields: (key, metric names to try in order, unit kind). "time" is converted to µs, "bytes"
# to MB (ncu's K / M / G are powers of 1000), the rest kept as ncu prints them.
FIELDS = (
    ("us", ("gpu__time_duration.sum",), "time"),
    ("dram_pct", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",), None),
    ("dram_read_mb", ("dram__bytes_read.sum",), "bytes"),
    ("dram_write_mb", ("dram__bytes_write.sum",), "bytes"),
    ("l2_hit_pct", ("lts__t_sector_hit_rate.pct",), None),
    ("sm_pct", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",), None),
    ("occupancy_pct", ("sm__warps_active.avg.pct_of_peak_sustained_active",), None),
    ("waves", ("launch__waves_per_multiprocessor",), None),
    ("registers", ("launch__registers_per_thread",), None),
    ("grid", ("launch__grid_size",), None),
    ("block", ("launch__block_size",), None),
    ("cycles_per_issue", ("smsp__average_warp_latency_per_inst_issued.ratio",), None),
)
_STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_BYTES_MB = {"byte": 1e-6, "B": 1e-6, "Kbyte": 1e-3, "KB": 1e-3, "Mbyte": 1.0, "MB": 1.0, "Gbyte": 1e3, "GB": 1e3}


def ncu_command(ncu: str, drafter: str, backend: str, csv_path: str) -> list[str]:
    """The ncu invocation that profiles the third step of `drafter` and writes its raw page to csv_path."""
    sections = [arg for s in SECTIONS for arg in ("--section", s)]
    return [ncu, "--target-processes", "all", "--profile-from-start", "off", "--clock-control", "none", *sections,
            "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--log-file", csv_path,
            sys.executable, "-m", "benchmarks.ncu_step", "run", "--drafter", drafter, "--backend", backend]


def run_step(drafter: str, backend: str) -> None:
    """The profiled program: two steps, then a third inside the profiler's range."""
    import torch

    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    from .bench_drafter_step import _inputs, run_ours

    inp = _inputs(DRAFTERS[drafter], B, CTX, "step")(torch.device("cuda"), torch.bfloat16, 0)
    for _ in range(2):
        run_ours(inp, backend, "step")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run_ours(inp, backend, "step")
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def number(text: str) -> float | None:
    """A value of ncu's CSV as a float (thousands separators dropped); None for n/a and other text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


class Kernel(NamedTuple):
    id: int
    name: str
    values: dict[str, str]  # metric name -> value as printed
    units: dict[str, str]   # metric name -> unit


def parse_csv(text: str) -> list[Kernel]:
    """The kernels of ncu's CSV output (its `==PROF==` and the program's lines around it are skipped), in the
    order ncu numbered them. Both layouts: the raw page (a row per kernel, a column per metric, and a units
    row without an ID under the header) and the details page (a row per kernel and metric: "Metric Name",
    "Metric Unit", "Metric Value")."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the output')
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    kernels: dict[int, Kernel] = {}

    def kernel(row) -> Kernel | None:
        ident = (row.get("ID") or "").strip()
        if not ident.isdigit():
            return None
        name = row.get("Kernel Name") or row.get("Function Name") or "?"
        return kernels.setdefault(int(ident), Kernel(int(ident), name, {}, {}))

    if rows and "Metric Name" in rows[0]:
        for row in rows:
            k = kernel(row)
            if k is not None and row.get("Metric Name"):
                k.values[row["Metric Name"]] = row.get("Metric Value") or ""
                k.units[row["Metric Name"]] = row.get("Metric Unit") or ""
    else:
        units = {}
        if rows and not (rows[0].get("ID") or "").strip():  # the units row
            units = {m: u for m, u in rows.pop(0).items() if m}
        for row in rows:
            k = kernel(row)
            if k is not None:
                k.values.update({m: v for m, v in row.items() if m})
                k.units.update(units)
    return [kernels[i] for i in sorted(kernels)]


def _scaled(value: float | None, unit: str, kind: str | None) -> float | None:
    """value in µs ("time") or MB ("bytes"); None for a unit this does not know (the CSV keeps it)."""
    if value is None or kind is None:
        return value
    scale = (_TIME_US if kind == "time" else _BYTES_MB).get(unit)
    return None if scale is None else value * scale


def kernel_summary(k: Kernel) -> dict:
    """The fields of one kernel (None where ncu gave no such metric, or in a unit not understood), its stall
    reasons largest first."""
    from .profile_step import short_name

    out = {"id": k.id, "name": short_name(k.name)}
    for key, names, kind in FIELDS:
        name = next((n for n in names if n in k.values), None)
        out[key] = None if name is None else _scaled(number(k.values[name]), k.units.get(name, ""), kind)
    if out["us"] and out["dram_read_mb"] is not None:
        out["dram_tbs"] = (out["dram_read_mb"] + (out["dram_write_mb"] or 0.0)) / out["us"]  # MB / µs = TB/s
    else:
        out["dram_tbs"] = None
    stalls = {m.group(1): number(v) for n, v in k.values.items() if (m := _STALL.match(n))}
    out["stalls"] = dict(sorted(((r, v) for r, v in stalls.items() if v), key=lambda rv: -rv[1]))
    return out


def summarize(text: str) -> list[dict]:
    return [kernel_summary(k) for k in parse_csv(text)]


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict) -> str:
    """Per drafter, a line per kernel: duration, DRAM (TB/s, % of peak), L2 hits, occupancy, waves, the top
    three stall reasons (cycles per issued instruction)."""
    lines = []
    for name, r in results["drafters"].items():
        if "error" in r:
            lines.append(f"{name}: {r['error']}")
            continue
        kernels = r["kernels"]
        total = sum(k["us"] or 0.0 for k in kernels)
        lines.append(f"{name} B={B} ctx={CTX} {results['backend']}: {len(kernels)} kernels, {total:.1f} µs one by one "
                     "(L2 flushed before each)")
        lines.append(f"  {'#':>2} {'kernel':32s} {'µs':>7} {'DRAM TB/s':>9} {'%pk':>4} {'L2 hit':>6} {'occ%':>5} "
                     f"{'waves':>5} {'regs':>4}  stalls (cycles per issued instruction)")
        for i, k in enumerate(kernels):
            stalls = ", ".join(f"{s} {v:.1f}" for s, v in list(k["stalls"].items())[:3])
            lines.append(f"  {i:2d} {k['name'][:32]:32s} {_fmt(k['us'], '7.2f')} {_fmt(k['dram_tbs'], '9.2f')} "
                         f"{_fmt(k['dram_pct'], '4.0f')} {_fmt(k['l2_hit_pct'], '6.1f')} "
                         f"{_fmt(k['occupancy_pct'], '5.1f')} {_fmt(k['waves'], '5.2f')} {_fmt(k['registers'], '4.0f')}"
                         f"  {stalls or '-'}")
    return "\n".join(lines)


def _profile(ncu: str, drafter: str, backend: str, csv_path: str, timeout: float) -> dict:
    """One drafter under ncu in its own process group (a time box kills ncu and the program it runs)."""
    if os.path.exists(csv_path):
        os.remove(csv_path)  # never read a previous run's
    t0 = time.monotonic()
    proc = subprocess.Popen(ncu_command(ncu, drafter, backend, csv_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s (ncu writes its results when the program ends)"}
    seconds = round(time.monotonic() - t0, 1)
    with open(csv_path[:-len(".csv")] + ".out", "w") as f:  # the program's output (and ncu's, if not in the log)
        f.write(out)
    try:
        with open(csv_path) as f:
            text = f.read()
    except OSError:
        text = ""
    try:  # the CSV where --log-file put it, else wherever ncu printed it
        kernels = summarize(text if '"ID"' in text else out)
    except ValueError as e:
        tail = " | ".join(out.strip().splitlines()[-5:])
        return {"error": f"ncu exited {proc.returncode} after {seconds} s, no kernels read ({e}); "
                         f"output: {tail[-600:]}"}
    return {"seconds": seconds, "returncode": proc.returncode, "csv": os.path.basename(csv_path), "kernels": kernels}


def profile_all(results: dict, ncu: str, names: list[str], out: str, budget: float) -> int:
    """Each drafter under ncu in turn, each with an equal share of the budget left when it starts, into
    results["drafters"] (the JSON at `out` rewritten after each, the CSVs beside it); 1 if any failed."""
    from .run_all import write_json

    deadline = time.monotonic() + budget
    status = 0
    for i, name in enumerate(names):
        left = (deadline - time.monotonic()) / (len(names) - i)
        if left < MIN_BOX_S:
            r = {"error": f"not run: a share of {left:.0f} s of the time budget"}
        else:
            r = _profile(ncu, name, results["backend"], os.path.join(os.path.dirname(os.path.abspath(out)),
                                                                     f"ncu_{name}.csv"), left)
        results["drafters"][name] = r
        status |= "error" in r or r.get("returncode", 0) != 0
        write_json(results, out)
    return int(status)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs="?", choices=("run",), help="(internal) the program ncu profiles")
    ap.add_argument("--out", help="the JSON to write (the CSVs beside it)")
    ap.add_argument("--table", metavar="JSON", help="print the table of a saved JSON instead")
    ap.add_argument("--drafters", default="31B,E2B", help="in this order (each gets an equal share of the "
                    "time left; 31B first: its GEMVs are the larger gap)")
    ap.add_argument("--drafter", help="(run) the drafter whose step to make")
    ap.add_argument("--backend", default="triton", choices=("triton", "cuda"))
    ap.add_argument("--time-budget", type=float, default=120.0, help="seconds for all drafters together")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return 0
    import torch

    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    if not torch.cuda.is_available():
        print("ncu_step needs a CUDA device: nothing was run", file=sys.stderr)
        return 2
    if args.command == "run":
        if args.drafter not in DRAFTERS:
            ap.error(f"run: --drafter must be one of {', '.join(DRAFTERS)}")
        run_step(args.drafter, args.backend)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu_step: ncu (Nsight Compute) is not on PATH: nothing was run", file=sys.stderr)
        return 2
    if not args.out:
        ap.error("--out is required")
    from .run_all import environment

    results = {"B": B, "ctx": CTX, "backend": args.backend, "sections": list(SECTIONS), "metrics": list(METRICS),
               "env": {**environment(torch), "device": torch.cuda.get_device_name()}, "drafters": {}}
    status = profile_all(results, ncu, args.drafters.split(","), args.out, args.time_budget)
    print(table(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
