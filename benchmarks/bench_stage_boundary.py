"""What one dependent stage boundary costs on this GPU: a kernel launch, a programmatic dependent launch,
a grid-wide barrier inside one persistent kernel, or a cluster barrier inside one thread block cluster
(the vectors in global or in distributed shared memory) or stores pushed between its SMs; what a group of
SMs streams from L2 and DRAM; E2B layers' GEMVs, whole sliding layers and the step's stages run in one
cluster; 31B's and E2B's glue GEMVs, and E2B's and 31B's attention at B = 1, streamed by every SM from a ring of
bulk copies (benchmarks/cuda/stage_boundary.cuh, cluster_gemv.cuh, stream_gemv.cuh and stream_attention.cuh say
how).

A drafter step is 27 dependent stages (launch_count); at E2B's sizes its bytes take ~10 µs, so the
cost of a boundary decides how close a step can get to issue 11's 20 µs, and whether a persistent
per-step kernel (barriers instead of launches) is worth writing. Measured before anyone writes it;
the predictions are in benchmarks/README.md ("Stage boundaries", and for the cluster modes and the
stream rates "A drafter step in one cluster").

    python -m benchmarks.bench_stage_boundary --out stage_boundary.json

Builds benchmarks/cuda/stage_boundary.cu with nvcc for GEMMA4_MTP_CUDA_ARCHS (default "80;90a"), runs
it (CUDA graphs, cudaEvent timing: each result is the slope of a 1-stage and an N-stage chain, the
graph's own launch taken out, each chain's first replay checked against the host; the drafters' layers
and GEMVs passed to it from drafter_shapes, shape_args), writes the JSON with the environment, and prints
a table with what an E2B drafter step's 20 such boundaries cost."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from gemma4_mtp_kernels import _toolchain as toolchain

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "cuda" / "stage_boundary.cu"
STEP_STAGES = 20  # an E2B / E4B B = 1 chain step's dependent launches (tests/test_launch_budget.py)


def build(out_dir: Path) -> Path:
    nvcc = toolchain.nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found (put it on PATH or set CUDA_HOME)")
    exe = out_dir / "stage_boundary"
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, *toolchain.NVCC_FLAGS, *toolchain.gencode_flags(toolchain.archs()),
           f"-I{ROOT / 'csrc' / 'include'}", str(SOURCE), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{done.stderr[-4000:]}")
    return exe


def layer_gemvs(drafter: str, layer_type: str) -> list[tuple[str, tuple[int, int, int, int]]]:
    """The GEMVs of one layer of `drafter` (gemma4_mtp.drafter.real_shape_config, from drafter_shapes) at one
    token, in order, as (projection, cluster_gemv stage (n, k, norm, glu)): q_proj (its input normed), o_proj,
    gate_up (normed), down_proj (the GLU folded into its input)."""
    from gemma4_mtp.drafter import real_shape_config

    t = real_shape_config(drafter).text
    hd, inter, q = t.hidden_size, t.intermediate_size, t.num_heads * t.attention[layer_type].head_dim
    return [("q_proj", (q, hd, 1, 0)), ("o_proj", (hd, q, 0, 0)), ("gate_up", (2 * inter, hd, 1, 0)),
            ("down_proj", (hd, inter, 0, 1))]


def layer_stages(drafter: str, layer_type: str) -> list[tuple[int, ...]]:
    """One layer of `drafter` as cluster_gemv stages (n, k, norm, glu[, window]): its GEMVs (layer_gemvs) and, for
    a sliding layer, between q_proj and o_proj the attention of its query heads over the window of its one
    key-value head. A full layer's attention is left out: a one-cluster step hands it to the whole GPU."""
    from gemma4_mtp.config import SLIDING
    from gemma4_mtp.drafter import real_shape_config

    (_, q_proj), *rest = layer_gemvs(drafter, layer_type)
    if layer_type != SLIDING:
        return [q_proj, *(st for _, st in rest)]
    spec = real_shape_config(drafter).text.attention[layer_type]
    if spec.num_kv_heads != 1:
        raise ValueError(f"{drafter}: the cluster's attention stage reads one key-value head, not "
                         f"{spec.num_kv_heads}")
    return [q_proj, (q_proj[0], spec.head_dim, 1, 0, spec.window), *(st for _, st in rest)]


def step_stages(drafter: str) -> list[tuple[int, ...]]:
    """`drafter`'s step as one cluster would run it, less what the cluster hands elsewhere (the full layers'
    attention, the whole GPU's) and the centroid head's selection of its tokens: the concat-down-projection
    (its input the token's embedding row and the target's hidden state, 2 Hb entries), every layer in order
    (layer_stages), then one stage of the GEMVs that read the final normed hidden state, side by side: the
    post-projection (Hb rows) and the centroid scores."""
    from gemma4_mtp.drafter import real_shape_config

    config = real_shape_config(drafter)
    if not config.use_ordered_embeddings:
        raise ValueError(f"{drafter}: a dense LM head (262144 rows) is not one cluster's stage")
    t, hb = config.text, config.backbone_hidden_size
    layers = [st for lt in t.layer_types for st in layer_stages(drafter, lt)]
    return [(t.hidden_size, 2 * hb, 0, 0), *layers, (hb + config.num_centroids, t.hidden_size, 1, 0)]


def glue_gemvs(drafter: str) -> dict[tuple[int, int, int], str]:
    """`drafter`'s distinct glue GEMVs at one token (layer_gemvs of both layer types; the ring GEMV has no GLU),
    (n, k, norm) -> name ("31B o_proj sliding / down_proj": the projections of that shape; the attention
    projections named by their layer type, the MLP's, the same in both, once)."""
    from gemma4_mtp.config import FULL, SLIDING

    roles = {}
    for lt, kind in ((FULL, "full"), (SLIDING, "sliding")):
        for name, (n, k, norm, _) in layer_gemvs(drafter, lt)[:2]:  # q_proj, o_proj
            roles.setdefault((n, k, norm), []).append(f"{name} {kind}")
    for name, (n, k, norm, _) in layer_gemvs(drafter, FULL)[2:]:  # gate_up, down_proj
        roles.setdefault((n, k, norm), []).append(name)
    return {shape: f"{drafter} " + " / ".join(names) for shape, names in roles.items()}


WIDE_DRAFTERS = ("31B", "E2B")  # 31B's GEMVs are bandwidth (8-32 MiB), E2B's latency (0.5-2 MiB)
# the "attention" rows' layers and keys: E2B's full layer at 8K and 32K, 31B's full layer at 8K, 31B's sliding
# layer over its window
ATTENTION_LAYERS = (("E2B", "full", 8192), ("E2B", "full", 32768), ("31B", "full", 8192), ("31B", "sliding", None))


def attention_layers() -> list[tuple[str, int, int, int, int]]:
    """The "attention" rows' layers: (name, query heads on a key-value head, head dimension, key-value heads,
    keys attended; a sliding layer its window) from drafter_shapes."""
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    out = []
    for drafter, kind, ctx in ATTENTION_LAYERS:
        d, kv = DRAFTERS[drafter], "Hkv_full" if kind == "full" else "Hkv_swa"
        dim = d["D_full"] if kind == "full" else d["D_swa"]
        out.append((f"{drafter} {kind}", d["Hq"] // d[kv], dim, d[kv], ctx or d["window"]))
    return out


def shape_args() -> list[str]:
    """The binary's layers and GEMVs: E2B's sliding and full layers and its step's stages ("gemv" rows), 31B's and
    E2B's glue GEMVs ("wide_gemv" rows), E2B's and 31B's attention layers ("attention" rows)."""
    from gemma4_mtp.config import FULL, SLIDING

    def stages(st):
        return ",".join(":".join(map(str, s)) for s in st)
    wide = [shape for d in WIDE_DRAFTERS for shape in glue_gemvs(d)]
    return [f"sliding_layer={stages(layer_stages('E2B', SLIDING))}", f"full_layer={stages(layer_stages('E2B', FULL))}",
            f"step={stages(step_stages('E2B'))}", f"wide={stages((n, k, norm, 0) for n, k, norm in wide)}",
            "attention=" + ",".join(":".join(map(str, layer[1:])) for layer in attention_layers())]


def name_wide_rows(results: dict) -> None:
    """Each wide_gemv row's "shape": the name of its (n, k, norm) among the drafters' glue GEMVs."""
    names = {shape: name for d in WIDE_DRAFTERS for shape, name in glue_gemvs(d).items()}
    for r in results.get("wide_gemv") or []:
        r.setdefault("shape", names.get((r["n"], r["k"], r.get("norm")), f"{r['n']} x {r['k']}"))


def name_attention_rows(results: dict) -> None:
    """Each attention row's "layer": its drafter and layer kind ("31B full"), from its heads, dimension and key-value
    heads, and its "kernel" (a program that printed none had E2B's full layer on the CUDA cores only)."""
    names = {layer[1:4]: layer[0] for layer in attention_layers()}
    for r in results.get("attention") or []:
        shape = (r.get("heads", 4), r.get("dim", 512), r.get("kv_heads", 1))
        r.setdefault("layer", names.get(shape, "{} heads of {} on each of {} key-value heads".format(*shape)))
        r.setdefault("kernel", "scalar")


def _why(r: dict) -> str:
    """A row that has no time: skipped (and why) or failed (and how)."""
    return f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR: {r['error']}"


def _check(r: dict) -> str:
    return "ok" if r["ok"] else "WRONG RESULT"


def table(results: dict, *, markdown: bool = False) -> str:
    """One row per (mode, programs): µs per added stage, one stage's whole replay, 27 of them, the check;
    as text for the terminal or as a markdown table (readme_tables)."""
    title = (f"{results['device']} ({results['sms']} SMs, sm_{results['cc'].replace('.', '')}), n = {results['n']} "
             f"uint32, {results['stages']} stages; µs per added dependent stage (graph-replayed), one stage's whole "
             f"replay, and {STEP_STAGES} stages (a drafter step's boundaries)")
    head = ("mode", "programs", "µs/stage", "1 stage µs", f"x {STEP_STAGES} µs", "check")
    rows = []
    for r in results["results"]:
        if "skipped" in r or "error" in r:
            rows.append((r["mode"], str(r["programs"]), "-", "-", "-", _why(r)))
            continue
        check = _check(r) + ("" if r["graph"] else " (stream launches: capture refused)")
        rows.append((r["mode"], str(r["programs"]), f"{r['us_per_stage']:.2f}", f"{r['us_one_stage']:.2f}",
                     f"{STEP_STAGES * r['us_per_stage']:.1f}", check))
    stream = results.get("stream") or []  # runs before 2026-12-06 had none
    s_title = "what `programs` SMs read (one program an SM): a slice each from L2 (re-read) or DRAM"
    s_head = ("source", "programs", "KiB/program", "µs/pass", "GB/s/program", "TB/s", "check")
    s_rows = []
    for r in stream:
        if "skipped" in r or "error" in r:
            s_rows.append((r["source"], str(r["programs"]), str(r["bytes_per_program"] // 1024), "-", "-", "-",
                           _why(r)))
            continue
        s_rows.append((r["source"], str(r["programs"]), str(r["bytes_per_program"] // 1024), f"{r['us_per_pass']:.2f}",
                       f"{r['gb_per_s_per_program']:.0f}", f"{r['tb_per_s']:.2f}", _check(r)))
    gemv = results.get("gemv") or []
    g_title = ("E2B's layers in one cluster: the full layer's GEMVs (q_proj, o_proj, gate_up, down_proj; its attention "
               "is the whole GPU's), whole sliding layers (q_norm and the attention over the window's keys and values "
               "between q_proj and o_proj), and the step (the concat-down-projection, the four layers, the post-"
               "projection and centroid scores), activations pushed between programs: one graph replay, and a layer "
               "(the slope from 1 to 4 layers)")
    g_head = ("layer", "programs", "layers", "stages", "MiB", "µs", "µs/layer", "check")
    one = {(r["layer"], r["programs"]): r["us"] for r in gemv if r.get("layers") == 1 and "us" in r}
    g_rows = []
    for r in gemv:
        head = (r["layer"], str(r["programs"]), str(r.get("layers", "-")), str(r["stages"]),
                f"{r['bytes'] / 2**20:.2f}")
        if "skipped" in r or "error" in r:
            g_rows.append((*head, "-", "-", _why(r)))
            continue
        base = one.get((r["layer"], r["programs"]))
        layers = r.get("layers", 1)
        per = f"{(r['us'] - base) / (layers - 1):.2f}" if layers > 1 and base is not None else "-"
        g_rows.append((*head, f"{r['us']:.2f}", per, _check(r)))

    def streamed(rows, name):  # a row per launch shape: what it reads, µs a launch, the rate
        out = []
        for r in rows:
            mib = f"{r['bytes'] / 2**20:g}"
            if "skipped" in r or "error" in r:
                out.append((str(r[name]), str(r["programs"]), mib, "-", "-", _why(r)))
                continue
            out.append((str(r[name]), str(r["programs"]), mib, f"{r['us']:.2f}", f"{r['bytes'] / r['us'] / 1e6:.2f}",
                        _check(r)))
        return out
    w_title = ("31B's and E2B's glue GEMVs at one token, each on every SM from a ring of bulk copies: µs a launch, "
               "back to back in one graph, every launch over its own copy of the weights (L2 cold)")
    w_head = ("shape", "programs", "MiB", "µs", "TB/s", "check")
    w_rows = streamed(results.get("wide_gemv") or [], "shape")  # runs before 2026-12-06 (evening) had none
    a_title = ("Attention at B = 1 (E2B's full layer: 4 query heads of 512 on one key-value head; 31B's full: 8 of 512 "
               "on each of 4; 31B's sliding: 2 of 256 on each of 16, its window; pages of 16 keys) on every SM from a "
               "ring of bulk copies, merged in clusters of 8, on the CUDA cores (scalar) or tensor cores (mma): µs a "
               "launch, back to back in one graph, every launch over its own copy of the cache (L2 cold)")
    a_head = ("layer", "kernel", "keys", "programs", "MiB", "µs", "TB/s", "check")
    attention = results.get("attention") or []  # runs before 2026-12-07 had none; "layer": name_attention_rows
    a_rows = [(r.get("layer", "-"), r.get("kernel", "scalar"), *row)
              for r, row in zip(attention, streamed(attention, "ctx"))]
    cut = (f"The run stopped in the row {results['cut_short_in']} (a hang or a crash): it and every row after it "
           "are missing." if results.get("cut_short_in") else None)
    if markdown:
        def md(t, h, rs):
            return [t, "", "| " + " | ".join(h) + " |", "|---" * len(h) + "|",
                    *("| " + " | ".join(r) + " |" for r in rs)]
        return "\n".join(md(title, head, rows) + (["", *md(s_title, s_head, s_rows)] if s_rows else [])
                         + (["", *md(g_title, g_head, g_rows)] if g_rows else [])
                         + (["", *md(w_title, w_head, w_rows)] if w_rows else [])
                         + (["", *md(a_title, a_head, a_rows)] if a_rows else []) + (["", cut] if cut else []))

    def line(row, widths):
        cells = (f"{c:{'<' if i == 0 else '>'}{w}}" for i, (c, w) in enumerate(zip(row, widths)))
        return " ".join(cells) + "  " + row[-1]
    out = [title, *(line(r, (14, 8, 9, 10, 9)) for r in (head, *rows))]
    if s_rows:
        out += ["", s_title, *(line(r, (6, 8, 11, 8, 12, 6)) for r in (s_head, *s_rows))]
    if g_rows:
        out += ["", g_title, *(line(r, (7, 8, 6, 6, 6, 8, 8)) for r in (g_head, *g_rows))]
    if w_rows:
        out += ["", w_title, *(line(r, (30, 8, 4, 7, 5)) for r in (w_head, *w_rows))]
    if a_rows:
        out += ["", a_title, *(line(r, (11, 6, 6, 8, 4, 7, 5)) for r in (a_head, *a_rows))]
    return "\n".join(out + (["", cut] if cut else []))


def salvage(stdout: str) -> dict | None:
    """The rows a run printed before it stopped (a hang killed at the time limit, a crash): the binary prints
    each row's opening before timing it and flushes each finished row, so everything before the last row's
    opening is whole rows; that row, and any section not reached, are left out, the open array closed.
    None when not even the header was printed (no device)."""
    cut = stdout.rfind("\n  {")
    if cut < 0:
        return None
    try:
        results = json.loads(stdout[:cut].rstrip().rstrip(",") + "\n]}")
    except json.JSONDecodeError:
        return None
    results["cut_short_in"] = stdout[cut:].strip()  # the row it stopped in
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--build-dir", default=str(ROOT / "build" / "stage_boundary"))
    ap.add_argument("--args", default="", help="passed to the binary, e.g. 'programs=1,132 stages=64'")
    ap.add_argument("--time-limit", type=float, default=240.0,
                    help="seconds for the whole command, the build included: the binary is stopped in time to "
                         "write what it measured (gpu_check.sh gives it less than its stage's box)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    import torch

    from .run_all import environment, write_json

    exe = build(Path(a.build_dir))
    shapes = shape_args()
    left = max(5.0, a.time_limit - (time.monotonic() - t0) - 3.0)  # ~3 s to write the JSON and the table
    try:
        done = subprocess.run([str(exe), *shapes, *a.args.split()], capture_output=True, text=True, timeout=left)
        stdout, stderr, status = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:  # a hang: what it printed so far is kept
        text = [t.decode(errors="replace") if isinstance(t, bytes) else t or "" for t in (e.stdout, e.stderr)]
        stdout, stderr, status = text[0], text[1], 124  # (POSIX hands the partial output over as bytes)
        stderr += f"\nstopped after {left:.0f} s"
    try:
        results = json.loads(stdout)
    except json.JSONDecodeError:  # no device, a crash or a hang part-way: the rows before it
        results = salvage(stdout)
        if results is None:
            print(f"stage_boundary exited {status} without its JSON:\n{stdout[-4000:]}\n{stderr[-4000:]}",
                  file=sys.stderr)
            return 1
        status = status or 1
    name_wide_rows(results)
    name_attention_rows(results)
    results["shape_args"] = shapes  # the layers and GEMVs it ran (before --args, which may replace them)
    results["env"] = environment(torch)
    results["exit_status"] = status
    write_json(results, a.out)
    print(table(results))
    if status != 0:
        print(f"stage_boundary exited {status}: {stderr.strip()[-2000:]}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
