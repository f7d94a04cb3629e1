"""Where a decode round's wall clock goes: host time per phase and GPU kernel time, per configuration.

On 2026-12-04 the main command's rounds cost ~3.3 ms (greedy chain) but ~5.8 ms (greedy (2, 2, 1) tree,
and a sampling chain), although the embedded pair's GPU work is a few hundred µs: the rounds are
host-bound, and no measurement said where. This runs `speculative_generate` on the embedded pair (the
main command's model and prompt) for each configuration, after a full warm-up run (compiles, captures),
and times each phase of every round on the host: `draft` (`speculative._draft`: the context, the static
buffers' copies, the draft graph's replay), `forward` (the target's: planning the trees, the copies, the
replay), `verify` (`tree_verify`: checks and launch), `read` (`speculative._read_round`: the one wait
for the device; what the GPU still had queued when the host got there), `commit` (the accepted K/V);
`other` is the rest of the round (the uniforms, the next round's inputs, the loop's bookkeeping). A
second run of each under torch.profiler gives the GPU's kernel time per round (CUDA only).

    python -m benchmarks.profile_decode --out decode_profile.json [--device cuda] [--max-new-tokens 64]

Reading it: a round costs about its host phases; `read` near zero means the host, not the GPU, sets
the pace (the GPU waits for the host), a large `read` that the GPU does. The prediction is in
benchmarks/README.md ("Decode rounds, phase by phase").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from unittest import mock

import torch

CONFIGS = {  # name: speculative_generate's shape arguments
    "target_only": dict(num_draft_tokens=0),
    "chain_greedy": dict(num_draft_tokens=4),
    "chain_greedy_k8": dict(num_draft_tokens=8),  # 4.8 tokens per forward on CPU against 3.56 at k = 4
    "tree_greedy": dict(num_draft_tokens=None, tree=(2, 2, 1)),
    "chain_sampled_drafts": dict(num_draft_tokens=4, temperature=0.8),
    "chain_argmax_drafts_sampling": dict(num_draft_tokens=4, temperature=0.8, sample_drafts=False),
}
PHASES = ("draft", "forward", "verify", "read", "commit")


class PhaseTimer:
    """Host seconds spent inside each phase's function, summed over a run, and when each `read` ended
    (the prefill's, then one per round: the differences are the rounds' wall times)."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.read_ends: list[float] = []

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.seconds[phase] += t1 - t0
                if phase == "read":
                    self.read_ends.append(t1)
        return timed

    def round_ms(self) -> list[float]:
        """Each round's wall time, from the end of the previous read (the prefill's for the first)."""
        return [round((b - a) * 1e3, 4) for a, b in zip(self.read_ends, self.read_ends[1:])]


@contextlib.contextmanager
def phases(timer: PhaseTimer, target):
    """The decode loop's phase functions, timed (the loop itself is not changed)."""
    from gemma4_mtp import speculative

    def target_forward(t, cuda_graphs):
        forward, runner = original_forward(t, cuda_graphs)
        return timer.wrap("forward", forward), runner

    original_forward = speculative._target_forward
    with mock.patch.object(speculative, "_draft", timer.wrap("draft", speculative._draft)), \
            mock.patch.object(speculative, "_read_round", timer.wrap("read", speculative._read_round)), \
            mock.patch.object(speculative, "_target_forward", target_forward), \
            mock.patch.object(speculative.K, "tree_verify", timer.wrap("verify", speculative.K.tree_verify)), \
            mock.patch.object(target, "commit", timer.wrap("commit", target.commit)):
        yield


def kernel_ms(run, device: torch.device) -> float | None:
    """GPU kernel time of run() in ms (the sum of every kernel's duration, CUPTI), or None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return sum(e.device_time_total for e in prof.key_averages()) / 1e3


def profile_config(name: str, target, drafter, prompt, *, max_new_tokens: int, device: torch.device) -> dict:
    from gemma4_mtp import speculative_generate

    kw = dict(CONFIGS[name], max_new_tokens=max_new_tokens, seed=0)
    kw.setdefault("temperature", 0.0)
    use = None if kw["num_draft_tokens"] == 0 else drafter

    def run():
        return speculative_generate(target, use, prompt, **kw)

    run()  # warm-up: compiles, and captures each shape's graph at its second use
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timer = PhaseTimer()
    with phases(timer, target):
        t0 = time.perf_counter()
        out = run()
        wall = time.perf_counter() - t0
    rounds = max(1, out.stats.rounds)
    host = {p: round(s * 1e3 / rounds, 4) for p, s in timer.seconds.items()}
    host["other"] = round(wall * 1e3 / rounds - sum(host.values()), 4)
    gpu = kernel_ms(run, device)
    return {"config": name, "args": dict(CONFIGS[name]), "rounds": out.stats.rounds,
            "new_tokens": out.stats.new_tokens[0], "tokens_per_forward": round(out.stats.tokens_per_target_forward, 3),
            "wall_ms": round(wall * 1e3, 3), "ms_per_round": round(wall * 1e3 / rounds, 4),
            "ms_per_token": round(wall * 1e3 / max(1, out.stats.new_tokens[0]), 4),
            "host_ms_per_round": host, "new_static_shapes_timed": out.stats.new_static_shapes,
            # every round's wall time: uniform rounds are steady state, a few long ones an eager round or
            # a capture (new_static_shapes_timed) or the host waiting for something else
            "round_ms": timer.round_ms(),
            "gpu_kernel_ms_per_round": None if gpu is None else round(gpu / rounds, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    args = p.parse_args(argv)
    from tokenizers import Tokenizer

    from gemma4_mtp import load_drafter, load_target
    from gemma4_mtp.__main__ import ASSETS, DEFAULT_PROMPT

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    target = load_target(ASSETS / "target", device=device)
    drafter = load_drafter(ASSETS / "drafter", device=device)
    prompt = torch.tensor(Tokenizer.from_file(str(ASSETS / "tokenizer.json")).encode(DEFAULT_PROMPT).ids)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "python": sys.version.split()[0], "backend": drafter.backend,
           "max_new_tokens": args.max_new_tokens}
    rows = []
    for name in names:
        rows.append(profile_config(name, target, drafter, prompt, max_new_tokens=args.max_new_tokens, device=device))
        r = rows[-1]
        spread = sorted(r["round_ms"]) or [0.0]
        print(f"{name:30s} {r['rounds']:3d} rounds, {r['ms_per_token']:7.3f} ms/token, {r['ms_per_round']:8.3f} "
              f"ms/round (median {spread[len(spread) // 2]:.3f}, max {spread[-1]:.3f}), "
              f"{r['new_static_shapes_timed']} captured while timed, host "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["host_ms_per_round"].items())
              + (f", GPU kernels {r['gpu_kernel_ms_per_round']:.3f} ms/round" if r["gpu_kernel_ms_per_round"] else ""),
              flush=True)
        with open(args.out, "w") as f:  # rewritten after every configuration: a kill keeps the finished ones
            json.dump({"env": env, "configs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
