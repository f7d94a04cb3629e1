"""Kernel launches of one eager drafter step, counted on CPU at the real shapes (no GPU, no weights).

The drafter (gemma4_mtp.drafter.random_drafter on the meta device: every weight, cache and
activation is a meta tensor, nothing holds values) runs
`Gemma4MTPDrafter.step` + `top_tokens(last, k)` with backend="triton". Two counters see everything
that would launch on a GPU:
- a TorchDispatchMode over the aten ops on meta tensors (standing for CUDA tensors) that launch a
  kernel: everything except views, allocations (empty*) and metadata ops; one launch per op (a
  cuBLAS GEMM that splits K launches two, so this is a lower bound for torch-side linears);
- `gemma4_mtp_kernels.triton.record.recording`, which sees every Triton launch the launchers make,
  as Triton's JIT would make it.
A host read of a device value (`.item()`, `int(t)`, `.tolist()`) cannot happen on meta tensors: it
raises, so a step that counts here also has no hidden device->host sync.

    python -m benchmarks.launch_count               # JSON: per drafter, B, k: launches by kind
    python -m benchmarks.launch_count --rounds      # a k = 4 chain round and a (2, 2, 1) tree round
    python -m benchmarks.launch_count --host-time   # adds host_us: wall time of one eager step here

`host_us` (median of 50 steps, after the counted ones) is the host time of an eager step on this
machine's CPU short of the driver: the ops' Python (validation, allocation, launch arithmetic),
torch's dispatch, and Triton's own launch path (binder, specialisation, cache key and lookup, launch
metadata), each launch stopping at a stub standing in for its compiled kernel. `host_ours_us` drops
every launch at Triton's JIT entry instead: our side alone. The driver call (~2-4 µs a launch on a
GPU host, 27 launches) comes on top of `host_us`.
Needs the real @triton.jit kernels: run it without TRITON_INTERPRET (tests do, in a subprocess).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that allocate or only describe memory: no kernel
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_reshape_alias", "_unsafe_view", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}


class KernelCounter(TorchDispatchMode):
    """Counts aten ops on meta tensors that would launch a CUDA kernel, by op name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors):
            self.ops[name] += 1
        return out


class _CachedStub:
    """Stands in for a compiled kernel in Triton's cache: the launch path runs to the driver call."""
    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        pass


def _host_us(fn, sms: int, repeats: int = 50, *, triton_path: bool) -> float:
    """Median wall time of fn() in µs. triton_path: each Triton launch runs Triton's own launch path
    (binder, specialisation, cache key and lookup, launch metadata) up to the driver call, which a
    stub in its kernel cache drops; otherwise every launch is dropped at Triton's JIT entry point
    (`JITFunction.run`). Recording only stands in for the device the launchers ask about."""
    from unittest import mock

    import triton
    from triton.runtime.jit import JITFunction

    from gemma4_mtp_kernels.triton.record import recording

    original_run = JITFunction.run

    def cache_stub(*, key, fn, compile, **_):
        fn.jit_function.device_caches[compile["device"]][0][key] = _CachedStub()
        return True  # this first call skips the compile; the next ones hit the stub

    times = []
    with recording(sms), mock.patch.object(JITFunction, "run", original_run if triton_path else
                                           lambda self, *args, **kwargs: None):
        triton.knobs.runtime.jit_cache_hook = cache_stub  # recording restores its own at the end
        fn()
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def count_step(name: str, B: int = 1, ctx: int = 8192, *, Q: int = 1, k: int = 1, sms: int = 132,
               host_time: bool = False) -> dict:
    """Launches of one eager step + top_tokens(last, k) at the real shapes of drafter `name`."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context
    from gemma4_mtp_kernels.triton.record import recording

    drafter = random_drafter(name, device="meta", backend="triton")
    dctx = synthetic_context(drafter, B, ctx, device="meta")
    Hb = drafter.config.backbone_hidden_size
    tokens = torch.empty(B, Q, dtype=torch.int64, device="meta")
    hidden = torch.empty(B, Q, Hb, dtype=torch.bfloat16, device="meta")
    with recording(sms):  # a first step allocates the launchers' cached counters (one memset, once)
        drafter.top_tokens(drafter.step(dctx, tokens, hidden)[0], k)
    counter = KernelCounter()
    with recording(sms) as triton_launches, counter:
        last, _ = drafter.step(dctx, tokens, hidden)
        drafter.top_tokens(last, k)
    kernels = collections.Counter(r.kernel.__name__ for r in triton_launches)
    torch_ops = sum(counter.ops.values())
    row = {"drafter": name, "B": B, "Q": Q, "ctx": ctx, "k": k, "layers": drafter.config.text.num_layers,
           "launches": torch_ops + len(triton_launches), "triton": len(triton_launches), "torch": torch_ops,
           "triton_kernels": dict(kernels), "torch_ops": dict(counter.ops)}
    if host_time:
        def step():
            drafter.top_tokens(drafter.step(dctx, tokens, hidden)[0], k)
        row["host_us"] = _host_us(step, sms, triton_path=True)
        row["host_ours_us"] = _host_us(step, sms, triton_path=False)
    return row


def count_round(name: str, widths, B: int = 1, ctx: int = 8192, *, sms: int = 132) -> dict:
    """Launches of one draft round: `graphs.draft_tree` over `widths` + the `tree_verify` of its nodes."""
    import gemma4_mtp_kernels as K
    from gemma4_mtp.drafter import random_drafter, synthetic_context
    from gemma4_mtp.graphs import draft_tree, tree_parents
    from gemma4_mtp_kernels.triton.record import recording

    drafter = random_drafter(name, device="meta", backend="triton")
    dctx = synthetic_context(drafter, B, ctx, device="meta")
    N, V = len(tree_parents(widths)), drafter.config.text.vocab_size
    pending = torch.empty(B, dtype=torch.int64, device="meta")
    hidden = torch.empty(B, drafter.config.backbone_hidden_size, dtype=torch.bfloat16, device="meta")
    parents = torch.empty(B, N, dtype=torch.int32, device="meta")
    logits = torch.empty(B, N, V, dtype=torch.bfloat16, device="meta")

    def round_():
        tokens = draft_tree(drafter, dctx, pending, hidden, widths)
        K.tree_verify(tokens, parents, logits, backend="triton")
    with recording(sms):
        round_()
    counter = KernelCounter()
    with recording(sms) as triton_launches, counter:
        round_()
    torch_ops = sum(counter.ops.values())
    return {"drafter": name, "B": B, "widths": list(widths), "launches": torch_ops + len(triton_launches),
            "triton": len(triton_launches), "torch": torch_ops, "torch_ops": dict(counter.ops)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", nargs="*", default=None, help="drafter names (default: all four)")
    p.add_argument("--batch", type=int, nargs="*", default=[1])
    p.add_argument("--queries", type=int, nargs="*", default=[1], help="queries per request (tree level width)")
    p.add_argument("--k", type=int, nargs="*", default=[1], help="top_tokens k (tree branching)")
    p.add_argument("--rounds", action="store_true", help="count a k = 4 chain and a (2, 2, 1) tree round instead")
    p.add_argument("--host-time", action="store_true", help="also time the eager step's host side (host_us)")
    args = p.parse_args(argv)
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    import triton
    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: launch counting records the real @triton.jit launches")
    names = args.drafter or list(DRAFTERS)
    if args.rounds:
        rows = [count_round(n, w, B) for n in names for B in args.batch for w in ((1, 1, 1, 1), (2, 2, 1))]
    else:
        rows = [count_step(n, B, Q=Q, k=k, host_time=args.host_time)
                for n in names for B in args.batch for Q in args.queries for k in args.k]
    json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
