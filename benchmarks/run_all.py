"""Run every op benchmark with its baselines and write one results JSON.

    python -m benchmarks.run_all --out results.json            # on a GPU: real shapes, timed
    python -m benchmarks.run_all --dry-run --out dry.json      # on CPU: tiny shapes, every path but timing
    python -m benchmarks.run_all --table results.json          # print the summary table of a results file

Per case the JSON holds the cost (bytes, FLOPs, where the bytes go), the floor on the measured device
(its copy bandwidth measured in the same run) and on the datasheet devices, and per baseline: status
("ok", "missing" with the reason, "error" with the exception, "not run" past the time budget), the
median time, GB/s, the fraction of the floor reached, and a sanity check against the reference op.
The file is rewritten after every case, so a run killed by a timeout leaves what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import traceback

if __package__ in (None, ""):  # python benchmarks/run_all.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"

# The drafter step / round comes first: it is the unit an engine pays for, and each module's unused
# share of the time budget passes on to the ones after it.
MODULES = ("bench_drafter_step", "bench_fused_glue", "bench_q_only_attention", "bench_centroid_logits",
           "bench_fused_concat_down_proj", "bench_tree_verify", "bench_dense_lm_head", "bench_softmax_sample")
# Shares of the time budget (others 1): on 2026-12-04 an equal seventh of 94 s timed two drafter steps
# and none of the draft rounds issue 11 sets targets for, while every single op had been timed before.
WEIGHTS = {"bench_drafter_step": len(MODULES) - 1}  # half the budget, the other modules share the rest
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def share(mods_left: list[str], seconds_left: float) -> float:
    """The seconds the first of mods_left may take of what is left: its weight's part (WEIGHTS)."""
    return seconds_left * WEIGHTS.get(mods_left[0], 1) / sum(WEIGHTS.get(m, 1) for m in mods_left)


def _git(*args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(torch) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
           "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
           "host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
        env["nvcc"] = nvcc.splitlines()[-1] if nvcc else None
    except (OSError, subprocess.SubprocessError):
        env["nvcc"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["device"] = "cpu (dry run)"
        env["driver"] = None
    import gemma4_mtp_kernels as g
    env["backends"] = {k: {"available": v.available, "detail": v.detail} for k, v in g.available_backends().items()}
    return env


class ContextLost(Exception):
    """A sticky CUDA error (an illegal address, a misaligned access, ...): the device context of this
    process is unusable, so nothing more can run in it. Carries the case's record so far."""

    def __init__(self, case: str, baseline: str, rec: dict):
        super().__init__(f"the CUDA context was lost in {case} / {baseline}")
        self.case, self.baseline, self.rec = case, baseline, rec


def _skipped(name: str, skip: dict[str, str]) -> str | None:
    """Why baseline `name` is not run: the reason of the first skipped prefix it starts with."""
    return next((why for prefix, why in skip.items() if name.startswith(prefix)), None)


def _run_case(case, *, torch, dry, device, dtype, l2_bytes, measured_dev, datasheet, timer, runs, skip=None):
    from gemma4_mtp_kernels import BackendUnavailableError

    from . import common
    c = case.cost
    rec = {"op": case.op, "case": case.label, "params": case.params, "bytes": c.bytes, "flops": c.flops,
           "parts": c.parts, "floor_datasheet_s": {d.key: c.floor_s(d) for d in datasheet},
           "floor_s": c.floor_s(measured_dev) if measured_dev else None, "results": []}
    sets = 1 if dry else timer.n_sets(c.bytes, l2_bytes)
    inputs = [case.make_inputs(device, dtype, seed) for seed in range(sets)]
    ref = case.reference(inputs[0])
    for name, factory in case.baselines.items():
        r = {"baseline": name}
        why = _skipped(name, skip or {})
        if why:
            rec["results"].append({"baseline": name, "status": "not run", "reason": why})
            continue
        try:
            calls = [factory(i) for i in inputs]
            if getattr(calls[0], "provenance", None):  # an external kernel says how it was obtained and called
                r["provenance"] = calls[0].provenance
            out = calls[0]()
            cmp = case.compare.get(name, case.default_compare)
            r["check"] = cmp(out, ref) if cmp else None
            if not dry:
                t = timer.time_calls(calls, runs=runs, graph=name not in case.eager)
                r.update(t.to_dict())
                r["gbps"] = c.bytes / t.median_s / 1e9
                r["tflops"] = c.flops / t.median_s / 1e12
                r["fraction_of_floor"] = rec["floor_s"] / t.median_s
            r["status"] = "ok"
        except (common.Missing, BackendUnavailableError) as e:
            r.update(status="missing", reason=str(e))
        except Exception as e:  # noqa: BLE001 - a failing baseline is a result, not a crash
            r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}",
                     where=traceback.format_exc(limit=3)[-600:])
        if device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except RuntimeError as e:  # sticky: every later call in this process would fail too
                if r.get("status") != "error":
                    r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
                rec["results"].append(r)
                lost = f"not run: the CUDA context was lost in baseline {name}"
                rec["results"] += [{"baseline": b, "status": "not run", "reason": lost}
                                   for b in list(case.baselines)[len(rec["results"]):]]
                raise ContextLost(case.label, name, rec) from e
        rec["results"].append(r)
    first = rec["results"][0]
    for r in rec["results"]:
        if r.get("time_s") and first.get("time_s"):
            r["speedup_vs_first"] = first["time_s"] / r["time_s"]
    del inputs
    return rec


def device_and_dtype(dry: bool):
    """Where the cases run and their element type: on CPU in fp32 for a dry run (every baseline's sanity
    check then exact enough to mean something), else on the GPU in bf16."""
    import torch
    return (torch.device("cpu"), torch.float32) if dry else (torch.device("cuda"), torch.bfloat16)


_WORKER: dict = {}
_INPUTS: dict = {}  # a worker's last case's first input set, (module, case index) -> inputs


def _warm_baseline(task: tuple[str, int, str, bool]) -> tuple[str, int, bool]:
    """A precompile worker: one baseline of one case run once on the case's first input set (made once
    for consecutive baselines of a case); (module, case index, whether it failed)."""
    import torch
    modname, i, name, dry = task
    if modname not in _WORKER:
        _WORKER[modname] = importlib.import_module(f"{__package__}.{modname}").cases(dry)
    case = _WORKER[modname][i]
    try:
        if (modname, i) not in _INPUTS:
            _INPUTS.clear()  # one case's inputs at a time (a 31B case's are GBs)
            _INPUTS[modname, i] = case.make_inputs(*device_and_dtype(dry), 0)
        case.baselines[name](_INPUTS[modname, i])()
        if not dry:
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a missing or failing baseline is the timed run's to report
        return modname, i, True
    return modname, i, False


def ordered(cases_of: dict[str, list], first=()) -> list[tuple[str, int]]:
    """(module, case index) of every case of the modules of `cases_of` (module -> its cases): the (op, case)
    pairs of `first` in their order (benchmarks.checklist.cases(): what the next GPU run must settle), then
    each module's other cases in module order."""
    listed = [(m, i, (c.op, c.label)) for m, cs in cases_of.items() for i, c in enumerate(cs)]
    rank = {key: n for n, key in enumerate(first)}
    head = sorted((x for x in listed if x[2] in rank), key=lambda x: rank[x[2]])
    return [(m, i) for m, i, _ in head] + [(m, i) for m, i, key in listed if key not in rank]


def precompile(modules, jobs: int, deadline: float, *, dry: bool, done=frozenset(), first=(), log=print) -> dict:
    """Every baseline of every case of `modules` (but the (op, label) pairs in `done`) run once, by `jobs`
    spawned processes, one baseline at a time each (the cases of `first` first, `ordered`), until `deadline`
    (time.monotonic()): what compiles on a first call (Triton's JIT, inductor) compiles there, in
    parallel, into the on-disk caches the timed process then reads, instead of one kernel after another
    inside the timed process's budget (on 2026-12-04 the benchmark stage's 94 s timed two drafter steps).
    A task is one baseline, not a case: a sweep case holds ~15 variants and a drafter step ~10, each its own
    compiles, which one worker a case ran one after another. A worker holds one case's inputs: on the largest
    cases (31B, B = 32, 32K: ~9 GB of cache) many workers at once can exceed the device's memory, and an
    allocation that fails counts its baseline failed here (the timed run makes the inputs again, alone).
    Bounded by the deadline whatever a worker does (one that dies loses its task, which then compiles when
    it is timed). Returns what ran."""
    cases_of = {m: importlib.import_module(f"{__package__}.{m}").cases(dry) for m in modules}
    picked = [(m, i) for m, i in ordered(cases_of, first) if (cases_of[m][i].op, cases_of[m][i].label) not in done]
    tasks = [(m, i, name, dry) for m, i in picked for name in cases_of[m][i].baselines]
    left = {(m, i): len(cases_of[m][i].baselines) for m, i in picked}  # baselines not yet run, per case
    ran = failed = 0
    pool = multiprocessing.get_context("spawn").Pool(jobs)
    try:
        results = pool.imap_unordered(_warm_baseline, tasks)
        for _ in tasks:
            try:
                wait = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
                m, i, bad = results.next(timeout=wait)
            except multiprocessing.TimeoutError:
                log(f"precompile: stopped at its deadline after {ran} of {len(tasks)} baselines")
                break
            ran, failed, left[m, i] = ran + 1, failed + bad, left[m, i] - 1
    finally:
        pool.terminate()
    return {"cases": len(picked), "cases_run": sum(n == 0 for n in left.values()), "baselines_run": ran,
            "baselines_failed": failed}


def run(*, dry: bool, out_path: str, ops=None, time_budget_s: float | None = None, runs: int = 30,
        log=print, resume: bool = False, skip_baselines=(), modules=None, precompile_jobs: int = 0) -> dict:
    """Runs the cases of every module of `modules` (default MODULES; of `ops`), those that
    benchmarks.checklist's predictions read before all others, and writes the results to out_path after
    each case. precompile_jobs > 1: `precompile` first, with at most 40% of the budget.
    resume: keep the cases out_path already holds (those with any baseline run) and run the others;
    skip_baselines: prefixes of baseline names recorded as not run (after a lost CUDA context).
    Raises ContextLost, after writing what finished, when a baseline leaves the CUDA context unusable."""
    import torch
    from . import checklist, devices, timer
    if not dry and not torch.cuda.is_available():
        raise SystemExit("run_all: no GPU (torch.cuda.is_available() is False); use --dry-run on a CPU machine")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())) if dry else torch.get_num_threads())
    start = time.monotonic()
    device, dtype = device_and_dtype(dry)
    results = {"schema": 1, "dry_run": dry, "dtype": str(dtype).replace("torch.", ""), "env": environment(torch),
               "device_peaks": {}, "cases": []}
    if resume and os.path.exists(out_path):
        with open(out_path) as f:
            kept = json.load(f)
        results["device_peaks"] = kept.get("device_peaks", {})
        results["cases"] = [c for c in kept["cases"] if any(r["status"] != "not run" for r in c["results"])]
        results["lost_contexts"] = kept.get("lost_contexts", []) + ([kept["context_lost"]] if "context_lost" in kept else [])
    done = {(c["op"], c["case"]) for c in results["cases"]}
    skip = {p: f"skipped: the CUDA context was lost in an earlier run of a baseline starting with {p!r}"
            for p in skip_baselines}
    datasheet = list(devices.DATASHEET.values())
    measured_dev, l2 = None, 0
    if not dry:
        peaks = results["device_peaks"]
        spec = devices.match(results["env"]["device"])
        if not peaks:  # a resumed run keeps the peaks its first process measured
            peaks["copy_bytes_per_s"] = timer.copy_bandwidth()
            peaks["matmul_flops_per_s"] = timer.matmul_flops()
            peaks["launch_floor_s"] = timer.launch_floor()
            peaks["datasheet"] = spec.key if spec else None
        measured_dev = devices.measured(results)
        l2 = spec.l2_bytes if spec else 64 << 20
        log(f"device {results['env']['device']}: copy {peaks['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"bf16 matmul {peaks['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, launch {peaks['launch_floor_s'] * 1e6:.2f} µs")
    mods = [m for m in modules or MODULES if not ops or any(o in m for o in ops)]
    first = checklist.cases()
    if precompile_jobs > 1:
        t0 = time.monotonic()
        budget = float("inf") if time_budget_s is None else 0.4 * (start + time_budget_s - t0)
        results["precompile"] = precompile(mods, precompile_jobs, t0 + budget, dry=dry, done=done, first=first,
                                           log=log)
        results["precompile"]["wall_s"] = time.monotonic() - t0
        log(f"precompile: {results['precompile']}")
    write_json(results, out_path)
    cases_of = {m: importlib.import_module(f".{m}", __package__).cases(dry) for m in mods}
    order = ordered(cases_of, first)
    wanted = set(first)
    n_first = sum((c.op, c.label) in wanted for cs in cases_of.values() for c in cs)  # `order`'s head
    deadline, module = None, None
    for n, (modname, i) in enumerate(order):
        case = cases_of[modname][i]
        # the checklist's cases may take the whole budget; then each module gets its weighted share of
        # what is left, so a slow op cannot starve the rest
        if time_budget_s is not None and n == 0 and n_first:
            deadline = start + time_budget_s
        if time_budget_s is not None and n >= n_first and modname != module:
            module = modname
            now = time.monotonic()
            left = list(dict.fromkeys(m for m, _ in order[n:]))
            deadline = now + share(left, start + time_budget_s - now)
        if (case.op, case.label) in done:
            continue
        if deadline is not None and time.monotonic() > deadline:
            results["cases"].append({"op": case.op, "case": case.label, "params": case.params,
                                     "bytes": case.cost.bytes, "flops": case.cost.flops, "parts": case.cost.parts,
                                     "floor_s": case.cost.floor_s(measured_dev) if measured_dev else None,
                                     "results": [{"baseline": b, "status": "not run",
                                                  "reason": "the time budget of this op was spent"}
                                                 for b in case.baselines]})
            continue
        t0 = time.monotonic()
        try:
            rec = _run_case(case, torch=torch, dry=dry, device=device, dtype=dtype, l2_bytes=l2,
                            measured_dev=measured_dev, datasheet=datasheet, timer=timer, runs=runs, skip=skip)
        except ContextLost as e:
            results["cases"].append(e.rec)
            results["context_lost"] = {"case": e.case, "baseline": e.baseline}
            write_json(results, out_path)
            raise
        rec["wall_s"] = time.monotonic() - t0  # what the case cost of the budget (compiles included)
        results["cases"].append(rec)
        write_json(results, out_path)
        log(f"{case.op:24s} {case.label:45s} {rec['wall_s']:6.1f} s")
    results["wall_s"] = time.monotonic() - start
    write_json(results, out_path)
    return results


def write_json(results: dict, path: str) -> None:
    """Write through a temporary file, so that a kill mid-write leaves the previous complete JSON."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def table(results: dict, *, markdown: bool = False) -> str:
    """The summary: one line per (case, baseline): time, GB/s, fraction of the floor, time in units
    of the device's launch floor (what bounds the small cases), speedup over the case's first
    baseline (the PyTorch composition, or the dense LM head for centroid cases)."""
    env = results["env"]
    peaks = results.get("device_peaks", {})
    head = [f"device: {env.get('device')}  driver: {env.get('driver')}  torch {env.get('torch')}  "
            f"triton {env.get('triton')}  CUDA {env.get('cuda_runtime')}  commit {str(env.get('commit'))[:10]}"
            f"{' (dirty)' if env.get('dirty') else ''}  dtype {results.get('dtype')}"]
    if peaks.get("copy_bytes_per_s"):
        head.append(f"measured copy bandwidth {peaks['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                    f"launch floor {peaks['launch_floor_s'] * 1e6:.2f} µs")
    if results.get("dry_run"):
        head.append("DRY RUN: no timings (CPU); floors are for the datasheet H200")
    launch = peaks.get("launch_floor_s")
    cols = ("op", "case", "baseline", "status", "floor µs", "time µs", "GB/s", "% floor", "x launch", "vs 1st",
            "check")
    rows = []
    for c in results["cases"]:
        floor = c.get("floor_s") or (c.get("floor_datasheet_s") or {}).get("H200")
        for r in c["results"]:
            chk = r.get("check") or {}
            ok = chk.get("ok") if isinstance(chk, dict) else None
            reason = r.get("reason", "").removeprefix(f"{c['op']}: ")
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {reason[:90]}"
            rows.append((c["op"], c["case"], r["baseline"], status,
                         f"{floor * 1e6:.2f}" if floor else "-",
                         f"{r['time_s'] * 1e6:.2f}" if r.get("time_s") else "-",
                         f"{r['gbps']:.0f}" if r.get("gbps") else "-",
                         f"{100 * r['fraction_of_floor']:.0f}%" if r.get("fraction_of_floor") else "-",
                         f"{r['time_s'] / launch:.1f}" if r.get("time_s") and launch else "-",
                         f"{r['speedup_vs_first']:.2f}x" if r.get("speedup_vs_first") else "-",
                         {True: "ok", False: "MISMATCH", None: "-"}[ok]))
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(head + [""] + lines)
    widths = [max(len(x[i]) for x in rows + [cols]) for i in range(len(cols))]
    fmt = "  ".join(f"{{:{w}s}}" for w in widths)
    return "\n".join(head + [fmt.format(*cols)] + [fmt.format(*r) for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="gemma4-mtp-kernels benchmarks")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "results.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, every code path except timing")
    p.add_argument("--ops", nargs="*", help="substrings of op names to run (default all)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later cases are recorded as not run")
    p.add_argument("--runs", type=int, default=30, help="timed repetitions per baseline (median reported)")
    p.add_argument("--precompile-jobs", type=int, default=0, metavar="N",
                   help="first run every baseline of every case once in N processes (on a GPU its compiles land "
                        "in the on-disk caches; at most 40%% of the time budget)")
    p.add_argument("--table", metavar="RESULTS", help="print the summary table of a results file and exit")
    p.add_argument("--markdown", action="store_true", help="table as markdown")
    p.add_argument("--plot", metavar="PNG", help="also draw the roofline plot (needs matplotlib)")
    p.add_argument("--resume", action="store_true", help="keep the cases --out already holds, run the rest")
    p.add_argument("--skip-baselines", default="", metavar="PREFIXES",
                   help="comma-separated prefixes of baseline names not to run (after a lost CUDA context)")
    args = p.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f), markdown=args.markdown))
        return 0
    if args.dry_run:
        # the triton backend runs on CPU tensors through its interpreter; it must be set before
        # any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch
        if not torch.cuda.is_available():
            print("run_all: no GPU (torch.cuda.is_available() is False); use --dry-run on a CPU machine",
                  file=sys.stderr)
            return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        results = run(dry=args.dry_run, out_path=args.out, ops=args.ops, time_budget_s=args.time_budget,
                      runs=args.runs, log=lambda s: print(s, file=sys.stderr, flush=True), resume=args.resume,
                      skip_baselines=[b for b in args.skip_baselines.split(",") if b],
                      precompile_jobs=args.precompile_jobs)
    except ContextLost as e:
        print(f"run_all: {e}; what finished is in {args.out} (rerun with --resume --skip-baselines "
              f"{e.baseline} for the rest)", file=sys.stderr)
        return 3
    if args.plot:
        from . import plot
        plot.plot(results, args.plot)
    print(table(results, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
