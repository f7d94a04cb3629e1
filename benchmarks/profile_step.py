"""Where a graph-replayed drafter step's time goes, kernel by kernel.

The 2026-12-04 run left issue 11 one question: the E2B step (B = 1, 8K) takes 171 µs while its bytes
take ~10 µs and its 24 stage boundaries ~34 µs (bench_stage_boundary), and on 31B programmatic
dependent launch costs 17 µs where it saves 9 on E2B. The op benchmarks time each op alone, with its
inputs cold; this times the step as an engine replays it. For each drafter and variant the step
(`bench_drafter_step.run_ours`, kind "step": `Gemma4MTPDrafter.step` + `top_tokens(last, 1)`) is
captured in one CUDA graph and replayed under torch.profiler (CUPTI records every kernel of a replay);
each kernel's duration and the gap from the previous kernel's end to its start (negative: the two
overlap, as programmatic dependent launch allows) are medians over the replays.

    python -m benchmarks.profile_step --out step_profile.json [--drafters E2B,31B] [--replays 20]

Variants: `triton`, `triton_no_pdl` (`_common.PDL` off: clean per-kernel durations and launch gaps),
`triton_pdl_at_exit` (`_common.PDL_EARLY_TRIGGER` off: the next kernel scheduled when each exits) and
`cuda`. Under PDL a kernel's recorded start is when its programs became resident, so its duration
includes its wait for the kernel before it: compare a kernel's duration with and without PDL to find
the kernel that PDL slows (a dependent's waiting programs take SM slots its predecessor wanted).
The prediction is in benchmarks/README.md ("Kernel by kernel").
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from unittest import mock

import torch

from gemma4_mtp_kernels.drafter_shapes import DRAFTERS
from gemma4_mtp_kernels.triton import _common

from .bench_drafter_step import _inputs, run_ours
from .timer import capture_graph

B, CTX = 1, 8192
VARIANTS = ("triton", "triton_no_pdl", "triton_pdl_at_exit", "cuda")


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list (CUDA names are long)."""
    name = re.sub(r"\(.*$", "", kernel)
    depth, out = 0, []
    for ch in name:  # drop <...> (nested) template argument lists
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("void ", "").strip()


def analyse(replays: list[list[tuple[str, float, float]]]) -> dict:
    """replays: per replay, its kernels in start order as (name, start µs, duration µs). Every replay of
    one graph launches the same kernels; returns per kernel position its name, median duration and
    median gap after the previous kernel's end, and per replay the medians of the span (first start
    to last end), the kernel time and the gaps."""
    if not replays or not replays[0]:
        raise ValueError("no kernels recorded")
    names = [k[0] for k in replays[0]]
    for i, r in enumerate(replays):
        if [k[0] for k in r] != names:
            raise ValueError(f"replay {i} launched other kernels than replay 0 ({len(r)} vs {len(names)})")
    kernels = []
    for pos, name in enumerate(names):
        durs = [r[pos][2] for r in replays]
        gaps = [r[pos][1] - (r[pos - 1][1] + r[pos - 1][2]) for r in replays] if pos else [0.0] * len(replays)
        kernels.append({"name": name, "us": statistics.median(durs), "gap_us": statistics.median(gaps)})
    spans = [r[-1][1] + r[-1][2] - r[0][1] for r in replays]
    busy = [sum(k[2] for k in r) for r in replays]
    return {"kernels": kernels, "n_kernels": len(names), "span_us": statistics.median(spans),
            "kernel_us": statistics.median(busy), "gap_us": statistics.median(s - b for s, b in zip(spans, busy))}


def split_replays(events: list[tuple[str, float, float]], n: int) -> list[list[tuple[str, float, float]]]:
    """The kernels of n back-to-back replays (start order) cut into n equal runs."""
    events = sorted(events, key=lambda e: e[1])
    if not events or len(events) % n:
        raise ValueError(f"{len(events)} kernels recorded for {n} replays: not the same kernels per replay")
    per = len(events) // n
    return [events[i * per:(i + 1) * per] for i in range(n)]


def _call(variant: str, inp: dict):
    backend = "cuda" if variant == "cuda" else "triton"
    pdl = variant != "triton_no_pdl"
    early = variant != "triton_pdl_at_exit"

    def call():
        with mock.patch.object(_common, "PDL", pdl and _common.PDL), \
                mock.patch.object(_common, "PDL_EARLY_TRIGGER", early and _common.PDL_EARLY_TRIGGER):
            return run_ours(inp, backend, "step")
    return call


def profile(name: str, variant: str, replays: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inp = _inputs(DRAFTERS[name], B, CTX, "step")(torch.device("cuda"), torch.bfloat16, 0)
    call = _call(variant, inp)
    call()  # compiles, fills the caches
    graph = capture_graph([call])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = [(short_name(e.name), e.time_range.start, e.time_range.end - e.time_range.start)
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return analyse(split_replays(events, replays))


def table(results: dict) -> str:
    lines = []
    for name, per in results["drafters"].items():
        for variant, r in per.items():
            if "error" in r:
                lines.append(f"{name} {variant}: ERROR {r['error']}")
                continue
            lines.append(f"{name} B={B} ctx={CTX} {variant}: {r['n_kernels']} kernels, span {r['span_us']:.1f} µs = "
                         f"kernels {r['kernel_us']:.1f} + gaps {r['gap_us']:.1f}")
            lines += [f"  {k['name'][:60]:60s} {k['us']:8.2f} µs  gap {k['gap_us']:7.2f}" for k in r["kernels"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--drafters", default="E2B,31B")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step needs a CUDA device: nothing was run", file=sys.stderr)
        return 2
    from .run_all import environment, write_json

    results = {"B": B, "ctx": CTX, "replays": args.replays, "env": environment(torch), "drafters": {}}
    status = 0
    for name in args.drafters.split(","):
        per = results["drafters"].setdefault(name, {})
        for variant in args.variants.split(","):
            try:
                per[variant] = profile(name, variant, args.replays)
            except Exception as e:  # one variant's failure is reported, the others still run
                per[variant] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                status = 1
            write_json(results, args.out)
    print(table(results))
    return status


if __name__ == "__main__":
    sys.exit(main())
