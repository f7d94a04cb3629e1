"""Launch configurations of the Triton kernels whose tiles and splits are heuristics, timed against those
heuristics at the real drafter shapes (GPU): the fused glue (rms_norm_q_rope, rms_norm_linear,
rms_norm_gate_up, and the MLP where it is one launch), the pre-projection (fused_concat_down_proj) and the attention (q_only_paged_attention).

Each case is an op benchmark's case (bench_fused_glue, bench_fused_concat_down_proj,
bench_q_only_attention) whose baselines are the Triton launch with the launcher's own choice
("triton", first: run_all's "vs 1st" column is the speedup over it) and with one or two of its choices
replaced: the keywords of the module's `launch_config` / `kernel_config` (e.g. "triton block_k=128
num_stages=4", attention's "triton min_tiles=4"). Each is checked against the reference and timed as run_all
times the op benchmarks (CUDA graph replays, cold L2), and each result carries the configuration its launch
got and the shape its launcher looked up (`provenance`). Why: at B = 1 the 31B glue
kernels stream their weights at 1.3-1.6 TB/s of 4.2 (2026-12-04) with ~16-24 KiB in flight per program
(64-column K blocks, 3 stages: the sm_90 TTGIR), and the E2B ones are latency chains whose split-K and
tile choices were never measured against anything (benchmarks/README.md, "Launch configurations").

    python -m benchmarks.tune_launch_configs --out tune.json [--time-budget 150] [--jobs 16]
    python -m benchmarks.tune_launch_configs --dry-run --out /tmp/tune.json   # CPU: tiny shapes, no timing
    python -m benchmarks.run_all --table tune.json                            # the whole table

--tuned-out writes the variants that beat the launcher's choice by at least MIN_GAIN, at the shapes they
were timed at, as a file the launchers apply (gemma4_mtp_kernels/triton/tuned.py, GEMMA4_MTP_TRITON_CONFIGS):
gpu_check.sh times the drafter step with it (bench_drafter_step's `triton_tuned`) in the same run.

On a GPU the variants are compiled first by --jobs worker processes (`run_all.precompile`), so that the
timed process spends its budget timing.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from unittest import mock

OPS = ("rms_norm_linear", "rms_norm_gate_up", "rms_norm_q_rope", "fused_concat_down_proj", "q_only_paged_attention")
# variants of the GEMV-shaped kernels (the glue and the pre-projection): deeper K blocks and pipelines
# put more weight bytes in flight per program; more warps more loads per block
GEMV_VARIANTS = (dict(block_k=32), dict(block_k=128), dict(block_k=256), dict(num_stages=2), dict(num_stages=4),
                 dict(num_stages=5), dict(num_warps=8), dict(block_k=128, num_stages=4),
                 dict(block_k=256, num_stages=4), dict(block_k=128, num_stages=4, num_warps=8))
BLOCK_NS = (16, 32, 64, 128)
MIN_TILES = (1, 4, 8)  # attention: key tiles per split at least (fewer, longer splits; MIN_TILES_PER_SPLIT)
# A variant goes into the tuned file when it is this much faster than the launcher's choice: the sweep's
# medians of 30 graph replays move by ~1-2% between runs of the same launch (2026-12-04 op cases).
MIN_GAIN = 1.05


MLP = "rms_norm_gate_up/mlp"  # the one-launch MLP's configuration (mlp_config): a tuned file's op of its own


def config_key(op: str, params: dict) -> str:
    """What a case's variants configure, as a tuned file names it: its op's configuration, or the one-launch
    MLP's (a gate_up case with down_proj rows)."""
    return MLP if op == "rms_norm_gate_up" and "down" in params else op


def config_function(key: str):
    """(module, name) of the configuration function a tuned file's op `key` sets keywords of."""
    import importlib

    from gemma4_mtp_kernels.triton import tuned
    module, name = tuned.CONFIG_FUNCTIONS[key]
    return importlib.import_module(f"gemma4_mtp_kernels.triton.{module}"), name


def default_config(op: str, params: dict, sms: int, elem_bytes: int) -> dict:
    """The launcher's own configuration for a case (what its variants change)."""
    key = config_key(op, params)
    module, _ = config_function(key)
    p = params
    if key == MLP:
        return module.mlp_config(p["T"], p["N"])
    if op == "rms_norm_linear":
        return module.launch_config(p["T"], p["H"], p["N"], sms)
    if op == "rms_norm_gate_up":
        return module.launch_config(p["T"], p["N"])
    if op == "rms_norm_q_rope":
        return module.launch_config(p["T"], p["N"], p["D"])
    if op == "fused_concat_down_proj":
        return module.launch_config(p["T"], p["Hb"], p["Hd"], sms)
    return module.kernel_config(p["D"], p["Q"] * (p["Hq"] // p["Hkv"]), elem_bytes)


def variants(op: str, params: dict, sms: int, elem_bytes: int) -> list[dict]:
    """The config function's keywords of every variant of a case: each differs from the launcher's own
    choice (default_config) in what it names."""
    cfg = default_config(op, params, sms, elem_bytes)
    if config_key(op, params) == MLP:  # programs of 16 / 64 rows, down_proj's rows in two tiles, warps, stages
        return ([dict(block_i=b) for b in (16, 64) if b != cfg["BLOCK_I"]]
                + [dict(block_n=128)] * (cfg["BLOCK_N"] != 128)
                + [dict(num_warps=8), dict(block_i=64, num_warps=8), dict(num_stages=2), dict(num_stages=4)])
    if op == "q_only_paged_attention":
        return ([dict(block_n=n) for n in (16, 32, 64) if n != cfg["BLOCK_N"]]
                + [dict(num_stages=s) for s in (2, 3, 4) if s != cfg["num_stages"]]
                + [dict(num_warps=w) for w in (4, 8) if w != cfg["num_warps"]]
                + [dict(min_tiles=m) for m in MIN_TILES if m != cfg["MIN_TILES"]])
    out = [kw for kw in GEMV_VARIANTS if any(cfg[{"block_k": "BLOCK_K"}.get(k, k)] != v for k, v in kw.items())]
    # q_rope: any slice dividing the head, up to a whole head per program (no other program to wait for)
    tiles = BLOCK_NS if op != "rms_norm_q_rope" else [n for n in (*BLOCK_NS, 256, 512) if params["D"] % n == 0]
    out += [dict(block_n=n) for n in tiles if n != cfg["BLOCK_N"]]
    if "split_k" in cfg:  # split-K kernels: no split, and half / twice the launcher's count
        H = params["H"] if op == "rms_norm_linear" else params["Hb"]
        blocks = -(-H // cfg["BLOCK_K"])
        splits = {1, max(1, cfg["split_k"] // 2), min(blocks, 2 * cfg["split_k"])} - {cfg["split_k"]}
        out += [dict(split_k=s) for s in sorted(splits)]
    return out


def variant_name(kw: dict) -> str:
    return " ".join(["triton"] + [f"{k}={v}" for k, v in kw.items()])


def configured(factory, key: str, kw: dict):
    """A baseline factory: the bench's own Triton baseline run with the keywords `kw` of the configuration
    function of `key` (config_key) in place for every launch (warm-up and capture included; they replace
    what a tuned file in force would set). The callable's provenance records the key, the keywords, the
    configuration the first launch got and the shape its launcher looked up (with the key, a tuned file's
    entry: `tuned.overrides`)."""
    from gemma4_mtp_kernels.triton import tuned
    module, name = config_function(key)
    original = getattr(module, name)
    original_overrides = tuned.overrides

    def make(inp):
        run = factory(inp)
        # what the launch got (run_all keeps a provenance that is truthy before the first call)
        seen: dict = {"op": key, "keywords": dict(kw), "launch_config": None, "shape": None}

        @functools.wraps(original)  # its signature is the original's (tuned.keywords reads it)
        def chosen(*args, **kwargs):
            cfg = original(*args, **{**kwargs, **kw})
            if seen["launch_config"] is None:
                seen["launch_config"] = dict(cfg)
            return cfg

        def looked_up(o, device, **shape):
            if o == key and seen["shape"] is None:
                seen["shape"] = dict(shape)
            return original_overrides(o, device, **shape)

        def call():
            with mock.patch.object(module, name, chosen), mock.patch.object(tuned, "overrides", looked_up):
                return run()
        call.provenance = seen
        return call
    return make


def cases(dry: bool) -> list:
    """The op benchmarks' cases of E2B and 31B (tiny ones in a dry run), most likely gain first: the
    B = 1 glue and pre-projection of 31B (bandwidth), of E2B (latency), then attention, then T = 8."""
    import dataclasses

    from gemma4_mtp_kernels.triton._common import num_sms

    from . import bench_fused_concat_down_proj, bench_fused_glue, bench_q_only_attention
    from .run_all import device_and_dtype
    device, dtype = device_and_dtype(dry)
    sms, elem_bytes = num_sms(device), dtype.itemsize
    # the whole-MLP cases where they are one launch (mlp_config's; above the one-launch rule they are gate_up
    # and down_proj, cases of their own)
    gate_up, _ = config_function(MLP)
    picked = [c for c in bench_fused_glue.cases(dry) if "down" not in c.params
              or gate_up.one_launch(c.params["T"], c.params["H"], c.params["N"], c.params["down"], elem_bytes)]
    picked += [c for c in bench_fused_concat_down_proj.cases(dry) if c.params["T"] <= 8]
    picked += bench_q_only_attention.cases(dry)
    if not dry:
        picked = [c for c in picked if c.params["drafter"] in ("E2B", "31B")]

    def rank(c):
        T = c.params.get("T", c.params.get("B", 1) * c.params.get("Q", 1))
        return (T > 1, c.op == "q_only_paged_attention", c.params["drafter"] != "31B")
    out, shapes = [], set()
    for c in sorted(picked, key=rank):
        # one case a launch shape: 31B's sliding o_proj is its down_proj's GEMV (1024 x 8192, no prologue)
        shape = (c.op, *sorted((k, v) for k, v in c.params.items() if k != "drafter"))
        if shape in shapes:
            continue
        shapes.add(shape)
        base = c.baselines["triton"]
        key = config_key(c.op, c.params)
        baselines = {"triton": configured(base, key, {})}
        for kw in variants(c.op, c.params, sms, elem_bytes):
            baselines[variant_name(kw)] = configured(base, key, kw)
        compare = {name: c.compare["triton"] for name in baselines} if "triton" in c.compare else {}
        out.append(dataclasses.replace(c, baselines=baselines, compare=compare))
    return out


def best(results: dict) -> list[dict]:
    """Per case: the launcher's own time and the fastest variant that passed its check."""
    rows = []
    for c in results["cases"]:
        ok = [r for r in c["results"] if r.get("time_s") and (r.get("check") or {}).get("ok")]
        default = next((r for r in ok if r["baseline"] == "triton"), None)
        if not ok or default is None:
            continue
        fastest = min(ok, key=lambda r: r["time_s"])
        rows.append({"op": c["op"], "case": c["case"], "default_us": default["time_s"] * 1e6,
                     "best": fastest["baseline"], "best_us": fastest["time_s"] * 1e6,
                     "gain": default["time_s"] / fastest["time_s"],
                     "floor_us": c["floor_s"] * 1e6 if c.get("floor_s") else None})
    return rows


def tuned_file(results: dict, device: str, min_gain: float = MIN_GAIN) -> dict:
    """The tuned-configuration file (gemma4_mtp_kernels/triton/tuned.py, schema 1) of a sweep's results: per
    case whose fastest checked variant beats the launcher's choice by min_gain or more, that variant's
    keywords at the shape its launcher looked up. Cases at the same shape (none at the drafters' shapes)
    keep the larger gain."""
    by_case = {c["case"]: c for c in results["cases"]}
    entries: dict = {}
    for row in best(results):
        if row["gain"] < min_gain or row["best"] == "triton":
            continue
        prov = next(r["provenance"] for r in by_case[row["case"]]["results"] if r["baseline"] == row["best"])
        if not prov.get("shape"):
            continue  # the launcher never looked up a shape (a launch that failed before it)
        key = (prov["op"], tuple(sorted(prov["shape"].items())))
        if key not in entries or entries[key]["gain"] < row["gain"]:
            entries[key] = {"op": prov["op"], "shape": prov["shape"], "config": prov["keywords"], "case": row["case"],
                            "default_us": round(row["default_us"], 2), "tuned_us": round(row["best_us"], 2),
                            "gain": round(row["gain"], 3)}
    return {"schema": 1, "device": device, "min_gain": min_gain, "env": results.get("env"),
            "entries": list(entries.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, every variant run and checked, no timing")
    p.add_argument("--time-budget", type=float, default=None, help="seconds in all (precompile included)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes that compile the variants first (GPU; run_all.precompile)")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--tuned-out", metavar="PATH", help="also write the winners as a tuned-configuration file "
                   "(GEMMA4_MTP_TRITON_CONFIGS) for this device")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    from . import run_all
    if not args.dry_run and not torch.cuda.is_available():
        print("tune_launch_configs: no GPU (torch.cuda.is_available() is False); use --dry-run on a CPU machine",
              file=sys.stderr)
        return 2
    log = functools.partial(print, file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        results = run_all.run(dry=args.dry_run, out_path=args.out, time_budget_s=args.time_budget, runs=args.runs,
                              log=log, modules=("tune_launch_configs",),
                              precompile_jobs=0 if args.dry_run else args.jobs)
    except run_all.ContextLost as e:
        print(f"tune_launch_configs: {e}; what finished is in {args.out}", file=sys.stderr)
        return 3
    results["best"] = best(results)
    run_all.write_json(results, args.out)
    if args.tuned_out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"
        tuned = tuned_file(results, device)
        run_all.write_json(tuned, args.tuned_out)
        print(f"tuned configurations: {len(tuned['entries'])} entries (>= {MIN_GAIN}x) in {args.tuned_out}")
    for r in results["best"]:
        floor = f"floor {r['floor_us']:.1f}" if r["floor_us"] else ""
        print(f"{r['op']:24s} {r['case']:40s} {r['default_us']:8.2f} µs -> {r['best_us']:8.2f} µs ({r['gain']:.2f}x) "
              f"{r['best']}  {floor}")
    if args.dry_run:
        print(json.dumps({c["case"]: sorted({r["status"] for r in c["results"]}) for c in results["cases"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
