"""Roofline plot of a results file: achieved GB/s of every timed (case, baseline) against the
measured copy-bandwidth roof, and the fraction of the floor each baseline reached, per case.

    python -m benchmarks.plot results.json roofline.png

A dry-run file has no timings: the plot then shows the floors only (bytes vs floor time), which
checks the drawing path without a GPU.
"""
from __future__ import annotations

import json
import sys


def plot(results: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peaks = results.get("device_peaks", {})
    roof = peaks.get("copy_bytes_per_s")
    n_cases = len(results["cases"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, max(7.0, 0.22 * n_cases)))
    markers = {"q_only_paged_attention": "o", "centroid_logits": "s", "fused_concat_down_proj": "^",
               "tree_verify": "D"}
    baselines = sorted({r["baseline"] for c in results["cases"] for r in c["results"]})
    colors = {b: plt.cm.tab20(i % 20) for i, b in enumerate(baselines)}
    timed = False
    for c in results["cases"]:
        for r in c["results"]:
            if r.get("time_s"):
                timed = True
                ax1.scatter(c["bytes"], r["gbps"], marker=markers.get(c["op"], "x"), color=colors[r["baseline"]], s=28)
    if timed:
        xs = sorted(c["bytes"] for c in results["cases"])
        if roof:
            ax1.plot([xs[0], xs[-1]], [roof / 1e9] * 2, "k--", label=f"measured copy {roof / 1e12:.2f} TB/s")
        ax1.set_ylabel("achieved GB/s (minimum bytes / time)")
        ax1.set_title(f"{results['env'].get('device')}: achieved bandwidth vs bytes moved")
    else:
        for c in results["cases"]:
            f = (c.get("floor_datasheet_s") or {}).get("H200")
            if f:
                ax1.scatter(c["bytes"], f * 1e6, marker=markers.get(c["op"], "x"), color="grey")
        ax1.set_ylabel("floor µs on H200 (datasheet)")
        ax1.set_title("dry run: floors only (no timings)")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("minimum bytes moved per call")
    for op, m in markers.items():
        ax1.scatter([], [], marker=m, color="k", label=op)
    for b in baselines:
        ax1.scatter([], [], marker="o", color=colors[b], label=b)
    ax1.legend(fontsize=7, loc="lower right")

    labels, idx = [], 0
    for c in results["cases"]:
        got = [r for r in c["results"] if r.get("fraction_of_floor")]
        if not got:
            continue
        for j, r in enumerate(got):
            ax2.barh(idx + j * 0.8 / len(got), 100 * r["fraction_of_floor"], height=0.8 / len(got),
                     color=colors[r["baseline"]])
        labels.append((idx + 0.4, f"{c['op'][:10]} {c['case']}"))
        idx += 1
    ax2.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=6)
    ax2.set_xlabel("% of the floor reached (floor time / time)")
    ax2.axvline(100, color="k", ls="--")
    ax2.set_title("fraction of the roofline floor" if labels else "no timings in this file")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m benchmarks.plot RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        results = json.load(f)
    try:
        print(plot(results, argv[1]))
    except ImportError as e:
        print(f"plot: matplotlib is not installed ({e}); pip install matplotlib", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
