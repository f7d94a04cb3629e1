"""Cost model: the minimum bytes moved and FLOPs of each op, a drafter step and a draft round, and
their floor times on H100 SXM / H200 / A100 80GB (datasheet peaks) or on a measured device.

Counting rules (what "minimum" means here):
- Every call reads each operand it needs once from HBM and writes each output once; nothing is
  assumed to stay in L2 between calls. Within a call, data needed by several programs (a K/V block
  for all Q x Hq/Hkv query rows, a weight row for all T tokens) counts once: that is the design goal
  the kernels are held to (SPEC §4.2, issue 4).
- bf16 storage (2 bytes) unless given; int32 indices (4 bytes); int64 token outputs (8 bytes).
- Drafter layers compute only Q (q_proj, q_norm, RoPE) and o_proj: no k/v projections. Their K/V
  is the target's: the full layer reads ctx * Hkv_full * D_full * 2 (K and V) * 2 bytes per request,
  each sliding layer min(ctx, window) entries of the target's sliding layer.
- A drafter step is costed as an ideally fused step: weights + K/V + LM head + the step's inputs
  and outputs; activations between the kernels (O(T * Hd)) are left out as negligible at T <= 64.
- A draft round is k steps plus one tree_verify over the target's logits of the N = 1 + k nodes.
  Each step re-reads all weights and K/V (the per-call rule above); where a round's working set fits
  in L2 (E2B at short context) a warm GPU can beat this floor, which is why the harness runs cold.
Floors ignore launch latency: a real step is several launches of a few microseconds each.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field

try:
    from . import devices
except ImportError:  # run as a script: python benchmarks/roofline.py
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))
    from benchmarks import devices

from gemma4_mtp_kernels.drafter_shapes import DRAFTERS  # noqa: E402  (SPEC §1)

BF16 = 2
IDX = 4
TOKEN = 8

# The drafter's layer pattern: three sliding layers then one full layer.
LAYER_TYPES = ("sliding", "sliding", "sliding", "full")


@dataclass
class Cost:
    """Bytes by category (what the bytes are) and total FLOPs of one call or a composition."""
    what: str
    parts: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0

    @property
    def bytes(self) -> float:
        return float(sum(self.parts.values()))

    def floor_s(self, device: devices.Device) -> float:
        return device.floor_s(self.bytes, self.flops)

    def __add__(self, other: "Cost") -> "Cost":
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Cost(self.what, parts, self.flops + other.flops)

    def to_dict(self, devs) -> dict:
        return {"what": self.what, "bytes": self.bytes, "flops": self.flops, "parts": self.parts,
                "floor_s": {d.key: self.floor_s(d) for d in devs}}


# ---------------------------------------------------------------- the four ops


def concat_down_proj(Hb: int, Hd: int, T: int, *, E: int = BF16) -> Cost:
    """fused_concat_down_proj: weight [Hd, 2Hb] once, T embedding rows, T hidden rows, T outputs."""
    return Cost("fused_concat_down_proj", {
        "weights: pre_projection": Hd * 2 * Hb * E,
        "embedding rows": T * Hb * E,
        "activations": T * Hb * E + T * Hd * E + T * IDX,
    }, flops=2.0 * T * Hd * 2 * Hb)


def attention(B: int, Q: int, Hq: int, Hkv: int, D: int, ctx: int, *, window: int | None = None, E: int = BF16,
              block_size: int = 16, kv_label: str = "target KV") -> Cost:
    """q_only_paged_attention: each request's attended K/V read once for all Q x Hq/Hkv query rows."""
    n = ctx if window is None else min(ctx, window)
    return Cost("q_only_paged_attention", {
        kv_label: B * n * Hkv * D * 2 * E,
        "activations": 2 * B * Q * Hq * D * E,  # q in, out
        "metadata": B * IDX + B * math.ceil(n / block_size) * IDX,
    }, flops=4.0 * B * Q * Hq * n * D)  # q.k and p.v


def centroid_head(Hd: int, vocab: int, centroids: int, top_k: int, T: int, *, output: str = "argmax", k: int = 1,
                  E: int = BF16) -> Cost:
    """centroid_logits: all centroids, the K = top_k * V/C candidate rows of lm_head per token."""
    K = top_k * vocab // centroids
    rows = min(T * K, vocab)  # distinct rows: tokens sharing a cluster read its rows once
    out = {"argmax": T * (TOKEN + 4), "topk": T * k * (TOKEN + 4), "sparse": T * K * (TOKEN + 4),
           "dense": T * vocab * 4}[output]
    return Cost("centroid_logits", {
        "centroids": centroids * Hd * E,
        "lm_head gather (centroid)": rows * Hd * E,
        "token_ordering": rows * IDX,
        "activations": T * Hd * E + out,
    }, flops=2.0 * T * centroids * Hd + 2.0 * T * K * Hd)


def dense_head(Hd: int, vocab: int, T: int, *, materialise_logits: bool, E: int = BF16) -> Cost:
    """The dense LM head + argmax. materialise_logits: the unfused composition (logits written in
    the model dtype and read back by argmax), as Hugging Face runs it; else a fused argmax."""
    parts = {"lm_head (dense)": vocab * Hd * E, "activations": T * Hd * E + T * TOKEN}
    if materialise_logits:
        parts["logits (write + read)"] = 2 * T * vocab * E
    return Cost("dense_lm_head_argmax", parts, flops=2.0 * T * vocab * Hd)


def tree_verify(B: int, N: int, vocab: int, *, sampling: bool = False, draft_probs: bool = False,
                E: int = BF16) -> Cost:
    """tree_verify: every node's target logits read once (all rows scanned in parallel)."""
    parts = {
        "verify: target logits": B * N * vocab * E,
        "metadata": B * N * (TOKEN + IDX) + B * N * (IDX + TOKEN) + 2 * B * IDX,  # in: tokens, parents; out
    }
    if sampling:
        parts["metadata"] += B * N * 2 * 4 + B * 4  # uniforms, temperature
    if draft_probs:
        parts["verify: draft probs"] = B * N * vocab * E
    # greedy: one compare per logit; sampling: scale, exp, sum, and the CDF walk
    return Cost("tree_verify", parts, flops=float(B * N * vocab * (5 if sampling else 1)))


def softmax_sample(B: int, vocab: int, *, E: int = 4) -> Cost:
    """softmax_sample: the logits read once (the heads' fp32 dense output by default) and q written
    once (fp32); the temperature, uniform and token per row."""
    parts = {"sample: logits": B * vocab * E, "sample: q written (fp32)": B * vocab * 4,
             "metadata": B * (4 + 8 + TOKEN)}
    # scale, exp, the two sums and the CDF search of one chunk
    return Cost("softmax_sample", parts, flops=float(B * vocab * 5))


def fused_glue(op: str, H: int, N: int, T: int, *, prologue: bool, E: int = BF16, down: int | None = None) -> Cost:
    """rms_norm_linear / rms_norm_gate_up / rms_norm_q_rope: the weight once (gate_up: two), T rows of
    x (and, with the layer prologue, of the residual, the residual written back, and two norm
    vectors), T output rows. down: gate_up with a down_weight [down, N] (the whole MLP): that weight
    once more, T output rows of `down`."""
    gate_up = op == "rms_norm_gate_up"
    out = N if down is None else down
    parts = {"weights: glue projection": N * H * E * (2 if gate_up else 1) + (down or 0) * N * E,
             "activations": T * H * E * (3 if prologue else 1) + T * out * E}
    if prologue:
        parts["weights: norms"] = 2 * H * E
    return Cost(op, parts, flops=2.0 * T * N * (H * (2 if gate_up else 1) + (down or 0)))


# ---------------------------------------------------------------- drafter step and round


def drafter_step(name: str, B: int, ctx: int, *, Q: int = 1, E: int = BF16) -> Cost:
    """One drafter forward for B requests with Q queries each (T = B * Q tokens), ideally fused."""
    d = DRAFTERS[name]
    T = B * Q
    Hb, Hd, Hq = d["Hb"], d["Hd"], d["Hq"]
    pre = concat_down_proj(Hb, Hd, T, E=E)
    parts = {"weights: pre_projection": pre.parts["weights: pre_projection"], "embedding rows": pre.parts["embedding rows"]}
    flops = pre.flops
    qo = mlp = norms = 0
    for kind in LAYER_TYPES:
        D = d["D_full"] if kind == "full" else d["D_swa"]
        qo += 2 * Hd * Hq * D
        mlp += 3 * Hd * d["inter"]
        norms += 4 * Hd + D  # input/post-attn/pre-ff/post-ff norms, q_norm
        if kind == "full":
            att = attention(B, Q, Hq, d["Hkv_full"], D, ctx, E=E, kv_label="target KV: full layer")
        else:
            att = attention(B, Q, Hq, d["Hkv_swa"], D, ctx, window=d["window"], E=E,
                            kv_label="target KV: sliding layers")
        for k, v in att.parts.items():
            if k.startswith("target KV"):
                parts[k] = parts.get(k, 0) + v
        flops += att.flops
    norms += Hd  # final norm
    post = Hb * Hd
    parts["weights: q_proj + o_proj"] = qo * E
    parts["weights: MLP"] = mlp * E
    parts["weights: norms"] = norms * E
    parts["weights: post_projection"] = post * E
    flops += 2.0 * T * (qo + mlp + post)
    if d["centroids"]:
        head = centroid_head(Hd, d["vocab"], d["centroids"], d["top_k"], T, E=E)
        for k in ("centroids", "lm_head gather (centroid)", "token_ordering"):
            parts[k] = head.parts[k]
    else:
        head = dense_head(Hd, d["vocab"], T, materialise_logits=False, E=E)
        parts["lm_head (dense)"] = head.parts["lm_head (dense)"]
    flops += head.flops
    # step I/O: hidden in, post-projected hidden out, token ids in and out
    parts["activations"] = 2 * T * Hb * E + T * (IDX + TOKEN)
    return Cost(f"{name} drafter step", parts, flops)


def draft_round(name: str, B: int, ctx: int, k: int, *, widths: tuple[int, ...] | None = None,
                E: int = BF16) -> Cost:
    """k drafter steps (step i with widths[i] queries per request; a chain by default) and the
    tree_verify of the N = 1 + sum(widths) nodes over the target's logits."""
    widths = tuple(widths) if widths is not None else (1,) * k
    if len(widths) != k:
        raise ValueError(f"widths: expected {k} entries (one per step), got {len(widths)}")
    total = Cost(f"{name} draft round")
    for w in widths:
        total = total + drafter_step(name, B, ctx, Q=w, E=E)
    total = total + tree_verify(B, 1 + sum(widths), DRAFTERS[name]["vocab"], E=E)
    total.what = f"{name} draft round (k={k}, B={B}, ctx={ctx})"
    return total


def grouped(cost: Cost) -> dict[str, float]:
    """Bytes by coarse group for 'what dominates': weights, target KV, LM head, verify logits, rest."""
    out: dict[str, float] = {}
    for k, v in cost.parts.items():
        if k.startswith("weights"):
            g = "weights"
        elif k.startswith("target KV"):
            g = "target KV"
        elif k in ("centroids", "lm_head gather (centroid)", "token_ordering", "lm_head (dense)"):
            g = "LM head"
        elif k.startswith("verify"):
            g = "verify logits"
        else:
            g = "other"
        out[g] = out.get(g, 0.0) + v
    return out


def dominant(cost: Cost) -> tuple[str, float]:
    g = grouped(cost)
    key = max(g, key=g.get)
    return key, g[key] / cost.bytes


# ---------------------------------------------------------------- CLI


def _devices(results: str | None) -> list[devices.Device]:
    devs = list(devices.DATASHEET.values())
    if results:
        devs.append(devices.measured(results))
    return devs


def _fmt_bytes(b: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= s:
            return f"{b / s:.2f} {unit}"
    return f"{b:.0f} B"


def _row(label: str, c: Cost, devs) -> str:
    floors = " | ".join(f"{c.floor_s(d) * 1e6:.2f}" for d in devs)
    return f"| {label} | {_fmt_bytes(c.bytes)} | {c.flops / 1e9:.3f} | {floors} |"


def op_table(devs, batches=(1, 8, 64), contexts=(2048, 8192, 32768), queries=(1, 4), tree_nodes=(5, 16, 64)) -> str:
    head = "| case | bytes | GFLOP | " + " | ".join(f"{d.key} µs" for d in devs) + " |"
    sep = "|" + "---|" * (3 + len(devs))
    lines = []
    for name, d in DRAFTERS.items():
        lines += [f"\n#### {name}\n", head, sep]
        for T in batches:
            lines.append(_row(f"concat_down_proj T={T}", concat_down_proj(d["Hb"], d["Hd"], T), devs))
        for B in batches:
            for Q in queries:
                for ctx in contexts:
                    lines.append(_row(f"attention full D=512 B={B} Q={Q} ctx={ctx}",
                                      attention(B, Q, d["Hq"], d["Hkv_full"], d["D_full"], ctx), devs))
                lines.append(_row(f"attention sliding D=256 B={B} Q={Q} ctx>={d['window']}",
                                  attention(B, Q, d["Hq"], d["Hkv_swa"], d["D_swa"], 10**9, window=d["window"]), devs))
        for T in batches:
            if d["centroids"]:
                lines.append(_row(f"centroid_logits argmax T={T}",
                                  centroid_head(d["Hd"], d["vocab"], d["centroids"], d["top_k"], T), devs))
            lines.append(_row(f"dense LM head + argmax (HF, logits materialised) T={T}",
                              dense_head(d["Hd"], d["vocab"], T, materialise_logits=True), devs))
    lines += ["\n#### tree_verify (V = 262144)\n", head, sep]
    for B in batches:
        for N in tree_nodes:
            lines.append(_row(f"tree_verify greedy B={B} N={N}", tree_verify(B, N, 262144), devs))
    return "\n".join(lines)


def round_table(devs, contexts=(8192, 32768), k: int = 4, batches=(1,), widths=None, step: bool = False) -> str:
    """Draft rounds (or single steps with step=True) per drafter, with where their bytes go."""
    head = ("| drafter | B | ctx | bytes | " + " | ".join(f"{d.key} µs" for d in devs)
            + " | weights | target KV | LM head | verify logits | dominant |")
    lines = [head, "|" + "---|" * (9 + len(devs))]
    for name in DRAFTERS:
        for B in batches:
            for ctx in contexts:
                c = drafter_step(name, B, ctx) if step else draft_round(name, B, ctx, k, widths=widths)
                g = grouped(c)
                pct = " | ".join(f"{100 * g.get(x, 0) / c.bytes:.0f}%" for x in ("weights", "target KV", "LM head", "verify logits"))
                floors = " | ".join(f"{c.floor_s(d) * 1e6:.1f}" for d in devs)
                lines.append(f"| {name} | {B} | {ctx} | {_fmt_bytes(c.bytes)} | {floors} | {pct} | {dominant(c)[0]} |")
    return "\n".join(lines)


def breakdown(name: str, B: int, ctx: int, k: int, widths=None) -> str:
    c = draft_round(name, B, ctx, k, widths=widths)
    lines = [f"{c.what}: {_fmt_bytes(c.bytes)}, {c.flops / 1e9:.2f} GFLOP"]
    for part, v in sorted(c.parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:32s} {_fmt_bytes(v):>10s}  {100 * v / c.bytes:5.1f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", help="a results JSON from run_all.py: add floors on its measured device")
    p.add_argument("--k", type=int, default=4, help="draft steps per round (default 4)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes of the round table")
    p.add_argument("--context", type=int, nargs="+", default=[8192, 32768], help="context lengths (default 8K 32K)")
    p.add_argument("--tree", type=int, nargs="+", help="queries per request at each draft step, e.g. 1 2 4 "
                   "(a tree round; sets k to the number of steps)")
    p.add_argument("--json", action="store_true", help="print rounds and steps as JSON instead of tables")
    p.add_argument("--breakdown", action="store_true", help="print where the bytes of each round go")
    args = p.parse_args(argv)
    devs = _devices(args.results)
    widths = tuple(args.tree) if args.tree else None
    k = len(widths) if widths else args.k
    ctxs = tuple(args.context)
    if args.json:
        out = {f"{n} B={B} ctx={ctx}": draft_round(n, B, ctx, k, widths=widths).to_dict(devs)
               for n in DRAFTERS for B in args.batch for ctx in ctxs}
        print(json.dumps(out, indent=1))
        return 0
    shape = f"tree widths {widths}" if widths else f"{k} chain steps"
    nodes = 1 + (sum(widths) if widths else k)
    print(f"### Draft round floors ({shape} + tree_verify of {nodes} nodes)\n")
    print(round_table(devs, ctxs, k=k, batches=tuple(args.batch), widths=widths))
    print("\n### One drafter step (Q = 1 per request)\n")
    print(round_table(devs, ctxs, batches=tuple(args.batch), step=True))
    if args.breakdown:
        for n in DRAFTERS:
            for ctx in ctxs:
                print()
                print(breakdown(n, args.batch[0], ctx, k, widths))
    print("\n### Per-op floors\n")
    print(op_table(devs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
