"""The open predictions of benchmarks/README.md that a run's results.json settles, as data: what the next
GPU run measures first (`run_all` runs these cases before any other) and what it is checked against.

    python -m benchmarks.checklist                  # the README's checklist table (markdown)
    python -m benchmarks.checklist RESULTS.json     # each prediction against that run's numbers
    python -m benchmarks.checklist --stage-boundary [STAGE_BOUNDARY.json]  # the same for bench_stage_boundary

Each row names a case of the benchmark modules (op, case label) and a baseline, the range predicted for
its median time in µs (graph-replayed unless the baseline says otherwise), the 2026-12-04 measurement it
was predicted from, and the README section that holds its model and its refutation rule. A row with
`minus` predicts a difference: its baseline's time less that (case, baseline)'s, from the same run. The
verdict of a measured row is "in range", "below" (faster than predicted) or "above" (slower: the row's
model is refuted unless its section says otherwise); a row whose case did not run is "not measured".
The predictions a run's stage_boundary.json settles (bench_stage_boundary: stage boundaries, SM streams,
layers in one cluster, GEMVs from a ring of bulk copies) are data too, STAGE_PREDICTIONS, each naming the
rows it reads. Predictions measured elsewhere (the main command, profile_step, profile_decode, the
launch-configuration sweep) stay in the README's hand-written table beside these.
"""
from __future__ import annotations

import json
import sys
from typing import NamedTuple


class Prediction(NamedTuple):
    what: str
    op: str
    case: str
    baseline: str
    lo: float
    hi: float
    before: float | None  # µs on 2026-12-04 (of the difference, for a row with minus); None: not measured then
    section: str
    minus: tuple[str, str] | None = None  # (case, baseline) of the same op whose time is subtracted


STEP_E2B, STEP_31B = "E2B step B=1 ctx=8192", "31B step B=1 ctx=8192"
ALL_FOUR = "the four sections of 2026-12-04 after \"Kernel by kernel\""
ONE_CALL = "A drafter step in one host call"
HEAD_CALL = "A draft step and its head in one host call"
SAMPLED_CALL = "A sampled draft step in one host call"
TOPK_SECTION = "The centroid head's top-k in its own launch"
CLUSTER_MAJOR = "The centroid head at large T: cluster-major phase 2"
ATTN_PIPELINE = "Attention's K/V tiles pipelined past the block table"
TUNED_SECTION = "The sweep's winners in the same run"
CUDA_CLUSTER_MAJOR = "The CUDA centroid head's cluster-major phase 2"
CUDA_GLUE_PROLOGUE = "The CUDA glue's prologue at several tokens"
CUDA_TAILS = "CUDA serial loads: q_rope's tail, attention's zero fill and merges, softmax_sample"
SHORT_SPLITS = "E2B's split-K GEMVs in two-block programs"
ONE_LAUNCH_MLP = "The MLP in one launch"
CUDA_MLP = "The CUDA MLP in one launch"
CUDA_STAGE_ROWS = "The CUDA glue's stage sized by its live tokens"
HF_WINDOW = "Hugging Face's sliding window merged in the attention kernel"
E2B_SWA, E2B_SWA_HF = "E2B sliding D=256 B=1 Q=1 ctx=8192", "E2B sliding D=256 B=1 Q=1 ctx=8192 window=513"
PREDICTIONS = (
    Prediction("E2B step", "drafter_step", STEP_E2B, "triton", 124, 152, 171.3,
               f"{ALL_FOUR}; {ATTN_PIPELINE}; {SHORT_SPLITS}; {ONE_LAUNCH_MLP}"),
    Prediction("31B step", "drafter_step", STEP_31B, "triton", 455, 485, 522.8, f"{ALL_FOUR}; {ATTN_PIPELINE}"),
    Prediction("E2B eager step, cuda: one host call", "drafter_step", STEP_E2B, "cuda_eager", 130, 250, 1292.6,
               f"{ONE_CALL}; {HEAD_CALL}"),
    Prediction("E2B eager step, cuda: the ops one by one", "drafter_step", STEP_E2B, "cuda_eager_ops", 1150, 1450,
               1292.6, ONE_CALL),
    Prediction("E2B eager step, cuda: the head's own call, less the head in the step's call", "drafter_step",
               STEP_E2B, "cuda_eager_head_apart", 30, 90, None, HEAD_CALL, minus=(STEP_E2B, "cuda_eager")),
    Prediction("31B eager step, cuda: one host call", "drafter_step", STEP_31B, "cuda_eager", 590, 700, 1598.1,
               ONE_CALL),
    Prediction("E2B eager sampled chain round, cuda: each level's head in calls of its own, less in the step's call",
               "draft_round", "E2B sampled chain round k=4 T=0.8 B=1 ctx=8192", "cuda_eager_head_apart", 800, 2400,
               None, SAMPLED_CALL, minus=("E2B sampled chain round k=4 T=0.8 B=1 ctx=8192", "cuda_eager")),
    Prediction("31B step without the weight prefetch, less with it", "drafter_step", STEP_31B, "triton_no_prefetch",
               7, 12, None, "Weights asked of L2 before the wait", minus=(STEP_31B, "triton")),
    Prediction("31B step, PDL triggered at each kernel's exit, less at its wait", "drafter_step", STEP_31B,
               "triton_pdl_at_exit", -23, -13, None, "Kernel by kernel", minus=(STEP_31B, "triton")),
    Prediction("E2B step, PDL triggered at each kernel's exit, less at its wait", "drafter_step", STEP_E2B,
               "triton_pdl_at_exit", 1, 7, None, "Kernel by kernel", minus=(STEP_E2B, "triton")),
    Prediction("31B step with the sweep's winners of the same run, less without", "drafter_step", STEP_31B,
               "triton_tuned", -110, -55, None, TUNED_SECTION, minus=(STEP_31B, "triton")),
    Prediction("E2B step with the sweep's winners of the same run, less without", "drafter_step", STEP_E2B,
               "triton_tuned", -8, 1, None, TUNED_SECTION, minus=(STEP_E2B, "triton")),
    Prediction("31B chain round (k = 4) with the sweep's winners of the same run, less without", "draft_round",
               "31B chain round k=4 B=1 ctx=8192", "triton_tuned", -440, -220, None, TUNED_SECTION,
               minus=("31B chain round k=4 B=1 ctx=8192", "triton")),
    Prediction("E2B sampled chain round less the greedy chain round", "draft_round",
               "E2B sampled chain round k=4 T=0.8 B=1 ctx=8192", "triton", 30, 50, None,
               "Sampled draft tokens in two launches", minus=("E2B chain round k=4 B=1 ctx=8192", "triton")),
    Prediction("31B sampled chain round less the greedy chain round", "draft_round",
               "31B sampled chain round k=4 T=0.8 B=1 ctx=8192", "triton", 30, 50, None,
               "Sampled draft tokens in two launches", minus=("31B chain round k=4 B=1 ctx=8192", "triton")),
    Prediction("E2B q_rope T=1", "rms_norm_q_rope", "E2B q_proj full T=1", "triton", 6.7, 7.3, 8.4,
               "q_rope's elected epilogue for one token"),
    Prediction("E2B gate_up T=1", "rms_norm_gate_up", "E2B gate_up T=1", "triton", 5.5, 5.8, 6.1,
               "One token's prologue from its row loaded whole"),
    Prediction("E2B pre-projection T=1", "fused_concat_down_proj", "E2B T=1", "triton", 2.8, 3.5, 5.23,
               "Serial L2 round trips inside the glue kernels"),
    Prediction("31B down_proj T=1", "rms_norm_linear", "31B down_proj T=1", "triton", 8.0, 8.7, 9.94,
               "Serial L2 round trips inside the glue kernels"),
    Prediction("31B q_proj T=1", "rms_norm_q_rope", "31B q_proj full T=1", "triton", 23, 24.5, 25.9,
               "The 31B prologue's statistics in 3 waves of loads instead of 8"),
    Prediction("E2B full attention 8K", "q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=8192", "triton",
               17, 21, 23.4, ATTN_PIPELINE),
    Prediction("E2B full attention 32K", "q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=32768", "triton",
               30, 40, 45.7, ATTN_PIPELINE),
    Prediction("E2B sliding attention 8K", "q_only_paged_attention", E2B_SWA, "triton", 7.5, 8.8, 9.2, ATTN_PIPELINE),
    Prediction("31B full attention 8K", "q_only_paged_attention", "31B full D=512 B=1 Q=1 ctx=8192", "triton",
               24, 40, None, ATTN_PIPELINE),
    Prediction("E2B centroid head, argmax T=1", "centroid_logits", "E2B argmax T=1", "triton", 12.3, 12.8, 13.7,
               "The attention merges and the centroid scores in fewer dependent loads"),
    Prediction("E2B centroid head, top-2 T=1", "centroid_logits", "E2B top2 T=1", "triton", 12.5, 15.5, None,
               TOPK_SECTION),
    Prediction("E2B centroid head top-2 T=1, CUDA", "centroid_logits", "E2B top2 T=1", "cuda", 15, 19, None,
               TOPK_SECTION),
    Prediction("E2B top-2 T=1 by sorting the sparse output, less the topk output", "centroid_logits",
               "E2B top2 T=1", "sparse_sort_triton", 20, 45, None, TOPK_SECTION, minus=("E2B top2 T=1", "triton")),
    Prediction("E2B centroid head, argmax T=8 (cluster-major)", "centroid_logits", "E2B argmax T=8", "triton", 15, 21,
               26.8, CLUSTER_MAJOR),
    Prediction("E2B centroid head, argmax T=64 (cluster-major)", "centroid_logits", "E2B argmax T=64", "triton", 30,
               50, 143.5, CLUSTER_MAJOR),
    Prediction("E2B argmax T=64 token-major (forced), less cluster-major", "centroid_logits", "E2B argmax T=64",
               "triton_token_major", 80, 115, None, CLUSTER_MAJOR, minus=("E2B argmax T=64", "triton")),
    Prediction("E2B argmax T=1 cluster-major (forced), less token-major", "centroid_logits", "E2B argmax T=1",
               "triton_cluster_major", -1, 4, None, CLUSTER_MAJOR, minus=("E2B argmax T=1", "triton")),
    Prediction("E2B centroid head, top-2 T=64 (cluster-major)", "centroid_logits", "E2B top2 T=64", "triton", 40, 60,
               None, CLUSTER_MAJOR),
    Prediction("E2B centroid head, argmax T=8, CUDA (cluster-major)", "centroid_logits", "E2B argmax T=8", "cuda", 15,
               22, 26.1, CUDA_CLUSTER_MAJOR),
    Prediction("E2B centroid head, argmax T=64, CUDA (cluster-major)", "centroid_logits", "E2B argmax T=64", "cuda",
               32, 50, 112.6, CUDA_CLUSTER_MAJOR),
    Prediction("E2B centroid head, top-2 T=64, CUDA (cluster-major)", "centroid_logits", "E2B top2 T=64", "cuda", 34,
               55, None, CUDA_CLUSTER_MAJOR),
    Prediction("E2B centroid head, argmax T=1, CUDA (token-major; phase 3's loads together)", "centroid_logits",
               "E2B argmax T=1", "cuda", 13.5, 16, 16.4, f"{CUDA_CLUSTER_MAJOR}; {CUDA_TAILS}"),
    Prediction("E2B argmax T=64 CUDA token-major (forced), less cluster-major", "centroid_logits", "E2B argmax T=64",
               "cuda_token_major", 55, 85, None, CUDA_CLUSTER_MAJOR, minus=("E2B argmax T=64", "cuda")),
    Prediction("E2B argmax T=1 CUDA cluster-major (forced), less token-major", "centroid_logits", "E2B argmax T=1",
               "cuda_cluster_major", 2, 7, None, CUDA_CLUSTER_MAJOR, minus=("E2B argmax T=1", "cuda")),
    Prediction("31B o_proj T=8, CUDA", "rms_norm_linear", "31B o_proj full T=8", "cuda", 15, 23, 76.9,
               f"{CUDA_GLUE_PROLOGUE}; {CUDA_STAGE_ROWS}"),
    Prediction("31B o_proj T=1, CUDA", "rms_norm_linear", "31B o_proj full T=1", "cuda", 17, 21, 23.5,
               f"{CUDA_GLUE_PROLOGUE}; {CUDA_STAGE_ROWS}"),
    Prediction("31B down_proj T=8, CUDA", "rms_norm_linear", "31B down_proj T=8", "cuda", 10, 14, 25.5,
               CUDA_GLUE_PROLOGUE),
    Prediction("31B down_proj T=1, CUDA", "rms_norm_linear", "31B down_proj T=1", "cuda", 9.5, 11.5, 11.5,
               CUDA_GLUE_PROLOGUE),
    Prediction("31B q_proj T=8, CUDA", "rms_norm_q_rope", "31B q_proj full T=8", "cuda", 31, 35, 38.1,
               CUDA_GLUE_PROLOGUE),
    Prediction("31B gate_up T=8, CUDA", "rms_norm_gate_up", "31B gate_up T=8", "cuda", 28, 31, 31.8,
               CUDA_GLUE_PROLOGUE),
    Prediction("E2B step, splits of >= 8 K blocks (the old rule), less two", "drafter_step", STEP_E2B,
               "triton_long_splits", 3, 7, None, f"{SHORT_SPLITS}; {ONE_LAUNCH_MLP}", minus=(STEP_E2B, "triton")),
    Prediction("E2B MLP T=1 in one launch", "rms_norm_gate_up", "E2B mlp T=1", "triton", 7.5, 9.5, None,
               ONE_LAUNCH_MLP),
    Prediction("E2B MLP T=1 as two launches, less one", "rms_norm_gate_up", "E2B mlp T=1", "triton_two_launch_mlp",
               0.5, 2.5, None, ONE_LAUNCH_MLP, minus=("E2B mlp T=1", "triton")),
    Prediction("E2B step with two-launch MLPs, less one-launch", "drafter_step", STEP_E2B, "triton_two_launch_mlp",
               2, 10, None, ONE_LAUNCH_MLP, minus=(STEP_E2B, "triton")),
    Prediction("E2B MLP T=1 in one launch, CUDA", "rms_norm_gate_up", "E2B mlp T=1", "cuda", 8, 10, None, CUDA_MLP),
    Prediction("E2B MLP T=1 as two CUDA launches, less one", "rms_norm_gate_up", "E2B mlp T=1", "cuda_two_launch_mlp",
               0.5, 2.5, None, CUDA_MLP, minus=("E2B mlp T=1", "cuda")),
    Prediction("E2B o_proj full T=1", "rms_norm_linear", "E2B o_proj full T=1", "triton", 3.2, 4.2, 5.13,
               SHORT_SPLITS),
    Prediction("E2B down_proj T=1", "rms_norm_linear", "E2B down_proj T=1", "triton", 3.2, 4.2, 5.04, SHORT_SPLITS),
    Prediction("E2B q_rope T=1, CUDA", "rms_norm_q_rope", "E2B q_proj full T=1", "cuda", 7.3, 8.4, 10.54,
               CUDA_TAILS),
    Prediction("31B q_rope T=1, CUDA", "rms_norm_q_rope", "31B q_proj full T=1", "cuda", 20.5, 21.8, 23.79,
               CUDA_TAILS),
    Prediction("E2B sliding attention 8K, CUDA", "q_only_paged_attention", E2B_SWA, "cuda", 8.5, 10.0, 12.17,
               CUDA_TAILS),
    Prediction("E2B full attention 8K, CUDA", "q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=8192", "cuda",
               15.5, 18.5, 21.78, CUDA_TAILS),
    Prediction("E2B full attention 32K, CUDA", "q_only_paged_attention", "E2B full D=512 B=1 Q=1 ctx=32768", "cuda",
               36, 40, 42.89, CUDA_TAILS),
    Prediction("softmax_sample, 4096 candidates, B=1, CUDA", "softmax_sample", "centroid head (4096 candidates) B=1",
               "cuda", 5, 9, None, CUDA_TAILS),
    Prediction("softmax_sample, V = 262144, B=1, CUDA", "softmax_sample", "dense head B=1", "cuda", 5, 9, None,
               CUDA_TAILS),
    Prediction("E2B step, CUDA", "drafter_step", STEP_E2B, "cuda", 166, 187, 203.3, f"{CUDA_TAILS}; {CUDA_MLP}"),
    Prediction("softmax_sample, 4096 candidates, B=1", "softmax_sample", "centroid head (4096 candidates) B=1",
               "triton", 5, 8, None, "Sampled draft tokens in two launches"),
    Prediction("softmax_sample, V = 262144, B=1", "softmax_sample", "dense head B=1", "triton", 5, 8, None,
               "Sampled draft tokens in two launches"),
    Prediction("softmax_sample, 4096 candidates, B=8", "softmax_sample", "centroid head (4096 candidates) B=8",
               "triton", 8, 12, None, "Sampled draft tokens in two launches"),
    Prediction("softmax_sample, 4096 candidates, B=32", "softmax_sample", "centroid head (4096 candidates) B=32",
               "triton", 25, 40, None, "Sampled draft tokens in two launches"),
    Prediction("31B dense head top-1 T=1", "dense_lm_head", "31B top1 T=1", "triton", 128, 136, 133.0,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-2 T=1", "dense_lm_head", "31B top2 T=1", "triton", 133, 142, 146.0,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=1", "dense_lm_head", "31B top8 T=1", "triton", 145, 175, 567.0,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=8", "dense_lm_head", "31B top8 T=8", "triton", 150, 180, 565.7,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=32", "dense_lm_head", "31B top8 T=32", "triton", 190, 260, 916.1,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-1 T=1, CUDA", "dense_lm_head", "31B top1 T=1", "cuda", 135, 150, 188.1,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-1 T=8, CUDA", "dense_lm_head", "31B top1 T=8", "cuda", 135, 155, 421.9,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-1 T=32, CUDA", "dense_lm_head", "31B top1 T=32", "cuda", 165, 220, 1640.2,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=1, CUDA", "dense_lm_head", "31B top8 T=1", "cuda", 140, 160, 212.6,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=8, CUDA", "dense_lm_head", "31B top8 T=8", "cuda", 140, 165, 609.4,
               "The dense head's top-k in passes that stop"),
    Prediction("31B dense head top-8 T=32, CUDA", "dense_lm_head", "31B top8 T=32", "cuda", 270, 330, 2361.5,
               "The dense head's top-k in passes that stop"),
    Prediction("E2B sliding attention 8K, Hugging Face's window (513 keys), less 512", "q_only_paged_attention",
               E2B_SWA_HF, "triton", -0.5, 1.0, None, HF_WINDOW, minus=(E2B_SWA, "triton")),
    Prediction("E2B sliding attention 8K, CUDA, Hugging Face's window (513 keys), less 512", "q_only_paged_attention",
               E2B_SWA_HF, "cuda", -0.5, 1.0, None, HF_WINDOW, minus=(E2B_SWA, "cuda")),
)


def cases() -> list[tuple[str, str]]:
    """The (op, case) pairs the predictions read, in the table's order, each once: what run_all runs first."""
    seen: dict[tuple[str, str], None] = {}
    for p in PREDICTIONS:
        seen.setdefault((p.op, p.case))
        if p.minus:
            seen.setdefault((p.op, p.minus[0]))
    return list(seen)


def _time_us(results: dict, op: str, case: str, baseline: str) -> float | None:
    for c in results.get("cases", []):
        if c["op"] == op and c["case"] == case:
            for r in c["results"]:
                if r["baseline"] == baseline and r.get("status") == "ok" and r.get("time_s"):
                    return r["time_s"] * 1e6
    return None


def _verdict(value: float | None, lo: float, hi: float) -> str:
    """A measurement against its predicted range: "below" is faster than predicted, "above" slower."""
    return "not measured" if value is None else "below" if value < lo else "above" if value > hi else "in range"


def verdicts(results: dict) -> list[dict]:
    """Each prediction with its measured value in `results` (µs; None if its case or baseline did not
    run) and its verdict."""
    rows = []
    for p in PREDICTIONS:
        value = _time_us(results, p.op, p.case, p.baseline)
        if value is not None and p.minus:
            other = _time_us(results, p.op, *p.minus)
            value = None if other is None else value - other
        rows.append({**p._asdict(), "measured": value, "verdict": _verdict(value, p.lo, p.hi)})
    return rows


def _baseline(p: Prediction) -> str:
    if not p.minus:
        return f"`{p.baseline}`"
    other = f"`{p.minus[1]}`" if p.minus[0] == p.case else f"`{p.minus[1]}` of {p.minus[0]}"
    return f"`{p.baseline}` - {other}"


# Where the predictions' baseline was measured: every range above is for this device.
PREDICTED_FOR = ("NVIDIA H200", 4.19e12)  # device name, measured copy bandwidth (bytes / s) on 2026-12-04


def device_note(results: dict) -> str | None:
    """A line saying so when `results` comes from another device than the predictions': the ranges are
    the H200's, so a bandwidth-bound row reads against them scaled by the copy bandwidths' ratio (given)
    and a latency-bound one (E2B's small kernels) about as it is; the verdicts are not rescaled."""
    device = results.get("env", {}).get("device")
    if device is None or device == PREDICTED_FOR[0]:
        return None
    copy = (results.get("device_peaks") or {}).get("copy_bytes_per_s")
    ratio = f"; its copy bandwidth {copy / 1e12:.2f} TB/s, {PREDICTED_FOR[1] / copy:.2f}x slower" if copy else ""
    return (f"Predicted for an {PREDICTED_FOR[0]} (copy {PREDICTED_FOR[1] / 1e12:.2f} TB/s); this run is on "
            f"{device}{ratio}: read bandwidth-bound rows against their range times that ratio (the verdicts "
            "below are not rescaled).")


def table(results: dict | None = None) -> str:
    """Markdown: one line per prediction; with `results`, its measurement and verdict (after a line naming
    the device when it is not the predictions')."""
    head = "| prediction | op: case | baseline | 2026-12-04 µs | predicted µs | section |"
    rule = "|---|---|---|---|---|---|"
    if results is not None:
        head, rule = head + " measured µs | verdict |", rule + "---|---|"
    note = device_note(results) if results is not None else None
    lines = [note, ""] if note else []
    lines += [head, rule]
    for row in (verdicts(results) if results is not None else [dict(p._asdict()) for p in PREDICTIONS]):
        p = Prediction(*(row[f] for f in Prediction._fields))
        before = "-" if p.before is None else f"{p.before:g}"
        line = f"| {p.what} | {p.op}: {p.case} | {_baseline(p)} | {before} | {p.lo:g} to {p.hi:g} | {p.section} |"
        if results is not None:
            measured = "-" if row["measured"] is None else f"{row['measured']:.1f}"
            line += f" {measured} | {row['verdict']} |"
        lines.append(line)
    return "\n".join(lines)


class StagePrediction(NamedTuple):
    what: str
    section: str  # the array of stage_boundary.json: "results" (the chains), "stream", "gemv" or "wide_gemv"
    match: tuple[tuple[str, object], ...]  # (key, value) pairs of the row read
    field: str    # its value predicted; "per_layer": the slope of `us` from its 1-layer to its 4-layer row
    lo: float
    hi: float
    unit: str
    today: str    # what it stands against (2026-12-04, or today's kernels)
    readme: str   # the README section with the model and the rule


CLUSTER = "A drafter step in one cluster"
SLIDING = "A drafter step in one cluster (whole sliding layers)"
WIDE = "31B's GEMVs from a ring of bulk copies"
ATTENTION = "Full attention from a ring of bulk copies"
ATTENTION_31B = "31B's attention from a ring of bulk copies"
STAGE_PREDICTIONS = (
    *(StagePrediction(f"`{mode}`, {n} programs, a stage", "results", (("mode", mode), ("programs", n)),
                      "us_per_stage", lo, hi, "µs", "`pdl` 1.27-1.40, `barrier` 1.43-1.73", CLUSTER)
      for mode, lo, hi in (("cluster", 1.0, 1.3), ("cluster_shared", 0.6, 1.0), ("cluster_push", 0.35, 0.6))
      for n in (2, 16)),
    StagePrediction("`stream` L2, 16 programs", "stream", (("source", "l2"), ("programs", 16)), "tb_per_s",
                    1.3, 2.1, "TB/s", "-", CLUSTER),
    StagePrediction("`stream` L2, 132 programs", "stream", (("source", "l2"), ("programs", 132)), "tb_per_s",
                    5, 8, "TB/s", "-", CLUSTER),
    StagePrediction("`stream` DRAM, 1 program", "stream", (("source", "dram"), ("programs", 1)),
                    "gb_per_s_per_program", 40, 70, "GB/s", "-", CLUSTER),
    StagePrediction("`stream` DRAM, 16 programs", "stream", (("source", "dram"), ("programs", 16)), "tb_per_s",
                    0.7, 1.1, "TB/s", "-", CLUSTER),
    StagePrediction("`stream` DRAM, 132 programs", "stream", (("source", "dram"), ("programs", 132)), "tb_per_s",
                    3.4, 4.0, "TB/s", "copy 4.19", CLUSTER),
    *(StagePrediction(f"E2B full layer's GEMVs in one cluster of {n}, a layer", "gemv",
                      (("layer", "full"), ("programs", n)), "per_layer", lo, hi, "µs", "~17-21 (predicted)", CLUSTER)
      for n, lo, hi in ((16, 3.5, 6), (8, 5, 9))),
    StagePrediction("E2B 4 full layers' GEMVs in one cluster of 16, one replay", "gemv",
                    (("layer", "full"), ("programs", 16), ("layers", 4)), "us", 16, 27, "µs", "-", CLUSTER),
    *(StagePrediction(f"E2B sliding layer in one cluster of {n}, a layer", "gemv",
                      (("layer", "sliding"), ("programs", n)), "per_layer", lo, hi, "µs", "33.8 (five kernels)",
                      SLIDING)
      for n, lo, hi in ((16, 4, 7.5), (8, 6, 11))),
    StagePrediction("E2B 4 sliding layers in one cluster of 16, one replay", "gemv",
                    (("layer", "sliding"), ("programs", 16), ("layers", 4)), "us", 18, 33, "µs", "-", SLIDING),
    *(StagePrediction(f"E2B step in one cluster of {n} (less the full attention and the head's selection), one "
                      "replay", "gemv", (("layer", "step"), ("programs", n)), "us", lo, hi, "µs",
                      "~134 (171 less the full attention's 23.4 and the centroid head's 13.7)", SLIDING)
      for n, lo, hi in ((16, 20, 37), (8, 29, 52))),
    *(StagePrediction(f"{shape}, 128 programs", "wide_gemv", (("shape", shape), ("programs", 128)), "us", lo, hi,
                      "µs", today, WIDE)
      for shape, lo, hi, today in (("31B q_proj full / gate_up", 10.5, 12.5, "q_proj 25.9, gate_up 22.3"),
                                   ("31B o_proj full", 10.5, 12.5, "15.8"),
                                   ("31B o_proj sliding / down_proj", 6.3, 7.7, "down_proj 10.7"),
                                   ("31B q_proj sliding", 6.3, 7.7, "-"),
                                   ("E2B q_proj full", 2.5, 3.5, "q_rope 8.4"),
                                   ("E2B o_proj full / down_proj", 2.5, 3.5, "5.13 / 5.04"),
                                   ("E2B q_proj sliding", 2.3, 3.3, "-"),
                                   ("E2B o_proj sliding", 2.3, 3.3, "-"),
                                   ("E2B gate_up", 2.7, 3.8, "6.1"))),
    *(StagePrediction(f"E2B full attention, {ctx // 1024}K keys, {n} programs{' on tensor cores' * (k == 'mma')}",
                      "attention", (("layer", "E2B full"), ("kernel", k), ("ctx", ctx), ("programs", n)), "us", lo, hi,
                      "µs", today, ATTENTION if k == "scalar" else ATTENTION_31B)
      for k in ("scalar", "mma")
      for ctx, n, lo, hi, today in ((8192, 128, 7.5, 11, "23.4 (17-21 predicted)"),
                                    (8192, 64, 7.5, 13, "23.4 (17-21 predicted)"),
                                    (32768, 128, 20, 24, "45.7 (30-40 predicted)"))),
    *(StagePrediction(f"31B full attention, 8K keys, {n} programs{' on tensor cores' * (k == 'mma')}", "attention",
                      (("layer", "31B full"), ("kernel", k), ("ctx", 8192), ("programs", n)), "us", lo, hi, "µs",
                      "not measured (24-40 predicted)", ATTENTION_31B)
      for k, n, lo, hi in (("scalar", 128, 23, 30), ("scalar", 64, 42, 55), ("mma", 128, 20, 24), ("mma", 64, 20, 27))),
    *(StagePrediction(f"31B sliding attention, its 1024-key window, 128 programs{' on tensor cores' * (k == 'mma')}",
                      "attention", (("layer", "31B sliding"), ("kernel", k), ("programs", 128)), "us", 7, 10, "µs",
                      "not measured", ATTENTION_31B)
      for k in ("scalar", "mma")),
)


def _row(sb: dict, section: str, match: tuple) -> dict | None:
    for r in sb.get(section) or []:
        if all(r.get(k) == v for k, v in match) and r.get("ok") and "error" not in r and "skipped" not in r:
            return r
    return None


def stage_value(sb: dict, p: StagePrediction) -> float | None:
    """p's measured value in a stage_boundary.json (None if its rows did not run or failed their check)."""
    if p.section == "attention":
        from .bench_stage_boundary import name_attention_rows
        name_attention_rows(sb)  # the rows' "layer", where the JSON has none
    if p.field == "per_layer":
        one, four = (_row(sb, p.section, (*p.match, ("layers", n))) for n in (1, 4))
        return None if one is None or four is None else (four["us"] - one["us"]) / 3
    r = _row(sb, p.section, p.match)
    return None if r is None else r.get(p.field)


def stage_table(sb: dict | None = None) -> str:
    """Markdown: one line per stage-boundary prediction; with a run's stage_boundary.json, its value and
    verdict."""
    head = "| prediction | predicted | today | section |"
    rule = "|---|---|---|---|"
    if sb is not None:
        head, rule = head + " measured | verdict |", rule + "---|---|"
    lines = [head, rule]
    for p in STAGE_PREDICTIONS:
        line = f"| {p.what} | {p.lo:g}-{p.hi:g} {p.unit} | {p.today} | {p.readme} |"
        if sb is not None:
            v = stage_value(sb, p)
            line += f" {'-' if v is None else f'{v:.2f}'} | {_verdict(v, p.lo, p.hi)} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    stage = bool(args) and args[0] == "--stage-boundary"
    if stage:
        args = args[1:]
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("\n".join(__doc__.strip().splitlines()[2:5]), file=sys.stderr)
        return 2
    results = None
    if args:
        with open(args[0]) as f:
            results = json.load(f)
    print(stage_table(results) if stage else table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
