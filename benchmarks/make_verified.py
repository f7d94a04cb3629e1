"""Generate gemma4_mtp_kernels/verified.py, the table `backend="auto"` follows, from the committed GPU
runs under benchmarks/results/<run>/ (results.json from run_all, gpu_suite.json from gpu_suite).

    python -m benchmarks.make_verified            # rewrite verified.py
    python -m benchmarks.make_verified --check    # exit 1 if verified.py is not what the results give

Rules, per device (the CUDA device name the run recorded) and op:
- only the newest run on that device that timed the op counts (a later run supersedes an earlier one,
  also where a backend that passed before now fails);
- a backend is a candidate for a case only if the GPU suite passed for (op, backend) in that run, its
  kernel was not rewritten after the run (REWRITTEN: the verdict and times were the replaced kernel's),
  and the case's result is ok, timed, and agreed with the reference;
- the case's choice is the fastest candidate; cases without one give no entry;
- cases with the same dtype and the same exact shape parameters (SHAPES) are ordered by the range
  parameter, and neighbours with the same choice merge into one range [lo, hi]. A call between two
  measured sizes with different choices, or outside every measured size, has no entry: `auto` sends
  it to Triton.
- a drafter step as a whole (STEP_EVIDENCE: `drafter_step` graph-replayed, `drafter_step_eager`) is chosen
  the same way from the drafter_step benchmark's step rows, a backend a candidate only where every op of
  the step (gemma4_mtp.drafter.STEP_OPS, the LM heads included: the one call runs the head too) passed the
  suite with it; an entry naming cuda makes an `auto` step one call into C++, anything else leaves it the
  ops one by one.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGET = os.path.join(ROOT, "gemma4_mtp_kernels", "verified.py")
CANDIDATES = ("triton", "cuda")  # the backends `auto` chooses between on CUDA tensors
# (op, backend) -> (date, what): a kernel rewritten on that date; runs from before it verify nothing of it
# (the next GPU run's suite and times do). Not every kernel change: one that replaces what a run measured.
REWRITTEN = {
    ("dense_lm_head", "cuda"): ("2026-12-05", "bf16 / fp16 rows take the tensor-core mma_rows_kernel, which "
                                              "replaced the CUDA-core kernel the 2026-12-04 run verified"),
    ("centroid_logits", "triton"): ("2026-12-05", "argmax / topk with T * top_k above the SMs take a cluster-major "
                                                  "phase 2 the 2026-12-04 run did not have"),
    ("centroid_logits", "cuda"): ("2026-12-05", "argmax / topk with T * top_k above the SMs take a cluster-major "
                                                "phase 2 the 2026-12-04 run did not have"),
    ("rms_norm_linear", "cuda"): ("2026-12-06", "without a residual or a norm (o_proj, down_proj) the CTA stages its k "
                                                "range alone: not the prologue the 2026-12-04 run timed (76.9 us at "
                                                "31B o_proj T=8); since 2026-12-06 a stage holds the live tokens "
                                                "only, and 31B's full o_proj at T <= 15 splits 8 ways, not 9"),
    ("rms_norm_gate_up", "cuda"): ("2026-12-06", "with a down_weight, E2B / E4B at T <= 4 run the whole MLP in the "
                                                 "gate_up kernel (its tree over the tiles' down partials), and since "
                                                 "2026-12-05 the prologue takes as many token rows a pass as keep "
                                                 "each in one batch of loads: neither is what the 2026-12-04 run "
                                                 "verified"),
    ("rms_norm_gate_up", "triton"): ("2026-12-06", "with a down_weight, E2B / E4B at T <= 4 take one new kernel "
                                                   "(gate/up and down_proj, `_mlp_kernel`) no run has verified"),
    ("rms_norm_q_rope", "cuda"): ("2026-12-05", "the prologue takes as many token rows a pass as keep each in one "
                                                "batch of loads: not the one the 2026-12-04 run timed at T > 1"),
    ("q_only_paged_attention", "cuda"): ("2026-12-05", "sm_90: a V row no copy fills is zeroed when its tile is "
                                                       "issued, not every stage before the first copy: not the "
                                                       "kernel the 2026-12-04 run verified"),
    ("q_only_paged_attention", "triton"): ("2026-12-05", "the key loop reads the block table a segment ahead, so its "
                                                         "K/V tiles are pipelined: not the loop the 2026-12-04 run timed"),
}

# op -> (parameters a call must match exactly, the parameter that ranges). The public ops pass these
# names to resolve(); shape_of() reads them from a benchmark case's params.
SHAPES = {
    "q_only_paged_attention": (("Q", "Hq", "Hkv", "D", "sliding"), "B"),
    "fused_concat_down_proj": (("Hb", "Hd"), "T"),
    "centroid_logits": (("Hd", "C", "V", "top_k", "output", "k"), "T"),
    "tree_verify": (("N", "V", "sampling", "draft_probs"), "B"),
    "dense_lm_head": (("Hd", "V", "k", "output"), "T"),
    "rms_norm_linear": (("H", "N"), "T"),
    "rms_norm_gate_up": (("H", "N", "down"), "T"),
    "rms_norm_q_rope": (("H", "N", "D"), "T"),
    "softmax_sample": (("V",), "B"),
    # a whole Gemma4MTPDrafter.step (STEP_EVIDENCE): the drafter by its two widths, one query a request
    "drafter_step": (("Hb", "Hd", "Q"), "B"),
    "drafter_step_eager": (("Hb", "Hd", "Q"), "B"),
}

# A drafter step with backend="auto" is either the ops one by one, each following its own entries, or one call
# into C++ (torch.ops.gemma4_mtp.drafter_step): its own evidence decides, from the drafter_step benchmark's step
# rows (the step and top_tokens(last, 1), B = 1 / 8 / 32, each backend's whole step). Graph-replayed rows decide
# for the steps of DraftGraphs' rounds, eager rows for every other step (there the host time is the step's
# time: 2685 us triton, 1293 cuda for E2B on the 2026-12-04 H200). evidence op -> backend -> its baseline.
STEP_EVIDENCE = {"drafter_step": {"triton": "triton", "cuda": "cuda"},
                 "drafter_step_eager": {"triton": "triton_eager", "cuda": "cuda_eager"}}


def shape_of(op: str, params: dict) -> dict:
    """The shape dict the public op (for a step: Gemma4MTPDrafter.step) passes to the dispatcher for the call a
    benchmark case makes."""
    p = dict(params)
    if op in STEP_EVIDENCE:
        from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

        d = DRAFTERS[p["drafter"]]
        p.update(Hb=d["Hb"], Hd=d["Hd"], Q=1)  # the benchmark's steps draft one token a request
    elif op == "q_only_paged_attention":
        p["sliding"] = p.get("window") is not None
    elif op == "centroid_logits":
        p.setdefault("output", "argmax")  # the centroid benchmark times output="argmax", the decode loop's call
        p.setdefault("k", 1)  # its topk cases say their k
    elif op == "tree_verify":
        p.setdefault("draft_probs", p["sampling"])  # its sampling cases are chains with draft probabilities
    elif op == "dense_lm_head":
        p.setdefault("output", "topk")  # the head benchmark times the top-k output, the drafter's call
    elif op == "rms_norm_gate_up":
        p.setdefault("down", 0)  # gate/up alone (the whole MLP's cases, since 2026-12-06, say its rows)
    exact, rng = SHAPES[op]
    return {k: p[k] for k in (*exact, rng)}


@dataclass
class Run:
    name: str  # the directory under benchmarks/results/
    results: dict
    suite: dict | None
    stage_boundary: dict | None = None  # stage_boundary.json (bench_stage_boundary), when the run has one

    @property
    def device(self) -> str:
        return self.results["env"]["device"]

    @property
    def date(self) -> str:
        return self.results["env"].get("date") or self.name

    def passed(self, op: str, backend: str) -> bool:
        """(op, backend) passed this run's GPU suite, and its kernel is still the one the run tested; for a
        step (STEP_EVIDENCE), every op it runs did."""
        if op in STEP_EVIDENCE:
            from gemma4_mtp.drafter import STEP_OPS

            return all(self.passed(o, backend) for o in STEP_OPS)
        rewritten = REWRITTEN.get((op, backend))
        if rewritten and self.date < rewritten[0]:
            return False
        return bool(self.suite and self.suite.get("ops", {}).get(op, {}).get(backend, {}).get("passed"))

    def suite_summary(self) -> str:
        if self.suite is None:
            return "no gpu_suite.json: nothing verified"
        if self.suite.get("note"):
            return self.suite["note"]
        passed = sorted(f"{op}/{b}" for op, per in self.suite.get("ops", {}).items() for b, s in per.items()
                        if s.get("passed"))
        done = "complete" if self.suite.get("complete") else "incomplete"
        return f"{done}; passed: {', '.join(passed) if passed else 'none'}"


def load_runs(results_dir: str = RESULTS) -> list[Run]:
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "results.json"))):
        d = os.path.dirname(path)
        if os.path.basename(d).startswith("gpu_check_"):  # gpu_check.sh's default $OUT: a run not committed yet
            continue
        with open(path) as f:
            results = json.load(f)
        if results.get("dry_run"):
            continue
        suite = None
        if os.path.exists(os.path.join(d, "gpu_suite.json")):
            with open(os.path.join(d, "gpu_suite.json")) as f:
                suite = json.load(f)
        stage_boundary = None
        if os.path.exists(os.path.join(d, "stage_boundary.json")):
            with open(os.path.join(d, "stage_boundary.json")) as f:
                stage_boundary = json.load(f)
        runs.append(Run(os.path.basename(d), results, suite, stage_boundary))
    return runs


def _timed(case: dict, backend: str) -> dict | None:
    r = next((r for r in case["results"] if r["baseline"] == backend), None)
    return r if r and r.get("status") == "ok" and r.get("time_s") else None


def _views(case: dict) -> dict:
    """The evidence ops a benchmark case speaks for: evidence op -> backend -> the case's baseline timing it."""
    if case["op"] == "drafter_step":
        return STEP_EVIDENCE if case["params"].get("kind") == "step" else {}
    return {case["op"]: {b: b for b in CANDIDATES}} if case["op"] in SHAPES else {}


def _choice(run: Run, case: dict, op: str):
    """(backend, note) of the fastest candidate of one case for evidence op `op`, or None."""
    cands = []
    for b, baseline in _views(case)[op].items():
        r = _timed(case, baseline)
        if r and (r.get("check") or {}).get("ok") is True and run.passed(op, b):
            cands.append((r["time_s"], b))
    if not cands:
        return None
    cands.sort()
    times = ", ".join(f"{b} {t * 1e6:.1f} us" for t, b in cands)
    return cands[0][1], f"{case['case']}: {times}"


def evidence(runs: list[Run]) -> dict:
    """(device, op, dtype) -> tuple of (exact pairs, (range name, lo, hi), backend, evidence)."""
    newest: dict[tuple[str, str], Run] = {}
    for run in runs:
        for case in run.results["cases"]:
            for op, baselines in _views(case).items():
                if any(_timed(case, b) for b in baselines.values()):
                    key = (run.device, op)
                    if key not in newest or run.date > newest[key].date:
                        newest[key] = run
    table = {}
    for (device, op), run in sorted(newest.items()):
        exact_keys, rng = SHAPES[op]
        dtype = run.results["dtype"]
        groups: dict[tuple, dict[int, list]] = {}
        for case in run.results["cases"]:
            if op not in _views(case):
                continue
            shape = shape_of(op, case["params"])
            exact = tuple((k, shape[k]) for k in exact_keys)
            groups.setdefault(exact, {}).setdefault(shape[rng], []).append(_choice(run, case, op))
        entries = []
        for exact, by_size in sorted(groups.items(), key=lambda kv: repr(kv[0])):
            runs_of_same = []  # [backend, lo, hi, notes]
            for size in sorted(by_size):
                picks = by_size[size]
                backends = {p[0] for p in picks if p}
                if len(backends) != 1 or None in picks:
                    runs_of_same.append(None)  # no choice here, or cases at this size disagree
                    continue
                (b,) = backends
                last = runs_of_same[-1] if runs_of_same else None
                if last and last[0] == b:
                    last[2] = size
                    last[3] += [p[1] for p in picks]
                else:
                    runs_of_same.append([b, size, size, [p[1] for p in picks]])
            for seg in runs_of_same:
                if seg:
                    b, lo, hi, notes = seg
                    entries.append((exact, (rng, lo, hi), b, f"{run.name}: " + "; ".join(notes)))
        if entries:
            table[(device, op, dtype)] = tuple(entries)
    return table


HEADER = '''"""GENERATED by `python -m benchmarks.make_verified` from the GPU runs committed under
benchmarks/results/ (results.json + gpu_suite.json): do not edit; commit a GPU run's directory and
rerun the generator.

For a call on CUDA tensors, `backend="auto"` looks up (device name, op, dtype) in EVIDENCE and takes
the backend of the first entry whose exact shape parameters equal the call's and whose range holds
the call's range parameter: the backend that passed the GPU suite on that device and was the fastest
of those that passed, in the newest run there that timed the op. Every other CUDA call goes to Triton.
`drafter_step` (graph-replayed) and `drafter_step_eager` entries name the backend of a whole drafter
step: cuda makes `Gemma4MTPDrafter.step` one call into C++, anything else leaves it the ops one by one.
"""
'''


def render(runs: list[Run], table: dict) -> str:
    lines = [HEADER, "# results directories read: (directory, device, date, commit, the GPU suite there)", "SOURCES = ("]
    for run in sorted(runs, key=lambda r: r.name):
        env = run.results["env"]
        lines.append(f"    {(run.name, run.device, run.date, str(env.get('commit'))[:10], run.suite_summary())!r},")
    lines += [")", "",
              "# (device, op, dtype) -> ((exact (name, value) pairs), (range name, lo, hi), backend, evidence), ...",
              "EVIDENCE = {"]
    for key, entries in sorted(table.items()):
        lines.append(f"    {key!r}: (")
        lines += [f"        {e!r}," for e in entries]
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def generate(results_dir: str = RESULTS) -> str:
    runs = load_runs(results_dir)
    return render(runs, evidence(runs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="generate gemma4_mtp_kernels/verified.py from benchmarks/results/")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--out", default=TARGET)
    p.add_argument("--check", action="store_true", help="exit 1 if --out differs from what the results give")
    args = p.parse_args(argv)
    text = generate(args.results)
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        if not same:
            print(f"{args.out} is stale: run python -m benchmarks.make_verified", file=sys.stderr)
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
