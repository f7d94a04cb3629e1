"""Kernel launches of one eager drafter step, counted on CPU at the real shapes (no GPU, no weights);
with --decode, the launches and the copies to the device of each round of the decode loop.

The drafter (gemma4_mtp.drafter.random_drafter on the meta device: every weight, cache and
activation is a meta tensor, nothing holds values) runs `Gemma4MTPDrafter.step_top_tokens` (`step` +
`top_tokens(last, k)`) with backend="triton". Two counters see everything that would launch on a GPU:
- a TorchDispatchMode over the aten ops on meta tensors (standing for CUDA tensors) that launch a
  kernel: everything except views, allocations (empty*) and metadata ops; one launch per op (a
  cuBLAS GEMM that splits K launches two, so this is a lower bound for torch-side linears);
- `gemma4_mtp_kernels.triton.record.recording`, which sees every Triton launch the launchers make,
  as Triton's JIT would make it.
A host read of a device value (`.item()`, `int(t)`, `.tolist()`) cannot happen on meta tensors: it
raises, so a step that counts here also has no hidden device->host sync.

    python -m benchmarks.launch_count               # JSON: per drafter, B, k: launches by kind
    python -m benchmarks.launch_count --rounds      # a k = 4 chain round and a (2, 2, 1) tree round
    python -m benchmarks.launch_count --query-position next  # steps over Hugging Face's sliding windows
    python -m benchmarks.launch_count --host-time   # adds host_us: wall time of one eager step here
    python -m benchmarks.launch_count --decode      # speculative_generate's rounds: launches, copies

`host_us` (median of 50 steps, after the counted ones) is the host time of an eager step on this
machine's CPU short of the driver: the ops' Python (validation, allocation, launch arithmetic),
torch's dispatch, and Triton's own launch path (binder, specialisation, cache key and lookup, launch
metadata), each launch stopping at a stub standing in for its compiled kernel. `host_ours_us` drops
every launch at Triton's JIT entry instead: our side alone. The driver call (~2-4 µs a launch on a
GPU host, 27 launches) comes on top of `host_us`. `host_cuda_us`: the same step with
backend="cuda" (the step and its head one torch custom op, its Python fake standing in for the C++ side);
`host_cuda_ops_us`: the same with every launch one (Gemma4MTPDrafter.one_call_step = False);
`host_cuda_sampled_us`: a sampled draft step (`step_sample_tokens`: the step, the head's logits and
softmax_sample in the one op), `host_cuda_sampled_apart_us`: the same as three calls (`step`, then
`sample_tokens`: the head's logits op and softmax_sample's).
Needs the real @triton.jit kernels: run it without TRITON_INTERPRET (tests do, in a subprocess).
"""
from __future__ import annotations

import argparse
import collections
import copy
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
    """Counts aten ops writing meta tensors, which would launch a CUDA kernel (or a copy), by op name."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        # an op launches on the device when it writes a device tensor (zeros_like(x, device="cpu") of a
        # device x is host work)
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(out)):
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
               host_time: bool = False, query_position: str = "last_cached") -> dict:
    """Launches of one eager step_top_tokens (step + top_tokens(last, k)) at the real shapes of drafter `name`
    (query_position "next": with Hugging Face's sliding window, one entry wider)."""
    from gemma4_mtp.drafter import random_drafter, synthetic_context
    from gemma4_mtp_kernels.triton.record import recording

    drafter = random_drafter(name, device="meta", backend="triton")
    dctx = synthetic_context(drafter, B, ctx, device="meta", query_position=query_position)
    Hb = drafter.config.backbone_hidden_size
    tokens = torch.empty(B, Q, dtype=torch.int64, device="meta")
    hidden = torch.empty(B, Q, Hb, dtype=torch.bfloat16, device="meta")
    with recording(sms):  # a first step allocates the launchers' cached counters (one memset, once)
        drafter.step_top_tokens(dctx, tokens, hidden, k)
    counter = KernelCounter()
    with recording(sms) as triton_launches, counter:
        drafter.step_top_tokens(dctx, tokens, hidden, k)
    kernels = collections.Counter(r.kernel.__name__ for r in triton_launches)
    torch_ops = sum(counter.ops.values())
    row = {"drafter": name, "B": B, "Q": Q, "ctx": ctx, "k": k, "query_position": query_position,
           "layers": drafter.config.text.num_layers,
           "sliding_layers": sum(t == "sliding_attention" for t in drafter.config.text.layer_types),
           "launches": torch_ops + len(triton_launches), "triton": len(triton_launches), "torch": torch_ops,
           "triton_kernels": dict(kernels), "torch_ops": dict(counter.ops)}
    if host_time:
        def top(d):  # the counted step, of `drafter` or of its backend="cuda" copy
            d.step_top_tokens(dctx, tokens, hidden, k)
        row["host_us"] = _host_us(lambda: top(drafter), sms, triton_path=True)
        row["host_ours_us"] = _host_us(lambda: top(drafter), sms, triton_path=False)
        row["host_cuda_us"] = _cuda_host_us(drafter, top)
        row["host_cuda_ops_us"] = _cuda_host_us(drafter, top, one_call=False)
        T, V = B * Q, drafter.config.text.vocab_size
        sampling = (torch.empty(T, device="meta"), torch.empty(T, dtype=torch.float64, device="meta"),
                    torch.empty(T, V, device="meta"))  # temperature, uniforms, probs_out
        row["host_cuda_sampled_us"] = _cuda_host_us(
            drafter, lambda d: d.step_sample_tokens(dctx, tokens, hidden, *sampling))
        row["host_cuda_sampled_apart_us"] = _cuda_host_us(
            drafter, lambda d: d._step_then_sample_tokens(dctx, tokens, hidden, *sampling))
    return row


def _cuda_host_us(drafter, step, repeats: int = 50, *, one_call: bool = True) -> float | None:
    """Median wall time in µs of step(d), an eager step of d, `drafter` with backend="cuda": the step (and
    what of its head step() asks) one torch custom op (one_call, Gemma4MTPDrafter.one_call_step) or every
    launch one, whose Python fake implementation (on meta tensors) stands in for the C++ side (argument
    checks, plans, workspace, cudaLaunchKernelEx: not measured here). None without the compiled extension."""
    from unittest import mock

    from gemma4_mtp_kernels import _dispatch
    from gemma4_mtp_kernels import cuda as cuda_backend

    if not cuda_backend.extension_status()[0]:
        return None
    meta_ok = _dispatch.BackendStatus(True, "meta tensors standing for CUDA tensors")
    with mock.patch.object(_dispatch, "_cuda_status", lambda device=None: meta_ok):
        cuda = copy.copy(drafter)
        cuda.backend, cuda.one_call_step = "cuda", one_call
        cuda._checked_glue = None
        times = []
        for i in range(repeats + 1):  # the first step checks the glue calls
            t0 = time.perf_counter()
            step(cuda)
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times[1:]) * 1e6, 1)


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


class TransferCounter(TorchDispatchMode):
    """Host-to-device transfers into meta tensors (standing for CUDA tensors), by kind: `async`, copies
    with non_blocking=True (gemma4_mtp.transfer: the host does not wait), and `blocking`, every other
    way host data reaches the device (a plain copy, an op taking a CPU tensor beside device tensors,
    `torch.tensor(..., device=...)`), each of which makes a CUDA host wait for the stream to drain."""

    def __init__(self):
        super().__init__()
        self.kinds: collections.Counter = collections.Counter()
        self.blocking: collections.Counter = collections.Counter()  # where: op name or constructor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [t for t in leaves if t.device.type == "cpu" and t.dim() > 0]  # 0-dim: a kernel argument
        out = func(*args, **kwargs)
        if name == "_to_copy" and args[0].device.type == "cpu" and getattr(kwargs.get("device"), "type", None) == "meta":
            self._count(kwargs.get("non_blocking", False), name)
        elif name == "copy_" and args[0].device.type == "meta" and args[1].device.type == "cpu":
            self._count(len(args) > 2 and args[2] or kwargs.get("non_blocking", False), name)
        elif host and any(t.device.type == "meta" for t in leaves):
            self._count(False, name)
        return out

    def _count(self, non_blocking: bool, where: str) -> None:
        self.kinds["async" if non_blocking else "blocking"] += 1
        if not non_blocking:
            self.blocking[where] += 1

    def __enter__(self):
        # torch.tensor / torch.as_tensor with a device copy their data below the dispatcher
        self._constructors = {n: getattr(torch, n) for n in ("tensor", "as_tensor")}

        def watched(ctor, n):
            def make(*args, **kwargs):
                device = kwargs.get("device")
                if device is not None and torch.device(device).type != "cpu":
                    self._count(False, f"torch.{n}(..., device=...)")
                return ctor(*args, **kwargs)
            return make
        for n, ctor in self._constructors.items():
            setattr(torch, n, watched(ctor, n))
        return super().__enter__()

    def __exit__(self, *exc):
        for n, ctor in self._constructors.items():
            setattr(torch, n, ctor)
        return super().__exit__(*exc)


def count_decode(shape: dict, *, max_new_tokens: int = 10, sms: int = 132) -> dict:
    """One `speculative_generate` of the embedded pair (gemma4_mtp's assets) with every weight, cache
    and activation on the meta device, its draft rounds and target forwards through their graph
    runners' static buffers (capture=False: the code a GPU captures, run eagerly), backend "triton".

    Each round's one host read (`speculative._read_round`) cannot run on meta tensors: it answers
    "nothing accepted, emit token 3" (so each round emits one token and commits no move), and for a
    tree "the root's second child accepted" (two tokens, and the accepted node's K/V moves, as a tree's
    accepted path usually does; its commit's launches count in the next round); any other host read
    raises. Counted per round (the prefill and its verification are round 0): launches
    (Triton and torch; `in_graphs`: those inside a runner's replay, what a GPU replays as one graph;
    `eager`: the rest, each a launch from the host) and host-to-device transfers (TransferCounter).
    No host time: torch's meta kernels cost several times a device op's dispatch."""
    from pathlib import Path
    from unittest import mock

    import gemma4_mtp
    from gemma4_mtp import load_drafter, load_target, speculative
    from gemma4_mtp.graphs import DraftGraphs, TargetGraphs, _Replays as Replays
    from gemma4_mtp_kernels.triton.record import recording

    assets = Path(gemma4_mtp.__file__).parent / "assets"
    target = load_target(assets / "target", device="meta")
    drafter = None
    if shape["num_draft_tokens"] != 0:
        drafter = load_drafter(assets / "drafter", device="meta", backend="triton")
        drafter.graph_runner = DraftGraphs(drafter, table_width=target.num_blocks, capture=False)
    target.graph_runner = TargetGraphs(target, capture=False)
    prompt = torch.arange(3, 3 + 40)
    rounds: list[dict] = []
    state: dict = {}

    def launched() -> int:
        return len(state["triton"]) + sum(state["kernels"].ops.values())

    def start():
        state["launches"], state["kernels"], state["transfers"] = recording(sms), KernelCounter(), TransferCounter()
        state["triton"] = state["launches"].__enter__()
        state["kernels"].__enter__()
        state["transfers"].__enter__()
        state["in_graphs"], state["graph_ops"] = 0, collections.Counter()

    def stop():
        state["transfers"].__exit__(None, None, None)
        state["kernels"].__exit__(None, None, None)
        state["launches"].__exit__(None, None, None)
        t, k = state["transfers"], state["kernels"]
        rounds.append({"triton": len(state["triton"]), "torch": sum(k.ops.values()),
                       "in_graphs": state["in_graphs"], "eager": launched() - state["in_graphs"],
                       "eager_torch_ops": dict(k.ops - state["graph_ops"]),
                       "h2d_async": t.kinds["async"], "h2d_blocking": t.kinds["blocking"],
                       "blocking_at": dict(t.blocking)})

    original_replay = Replays.replay

    def replay(e):  # what a GPU replays as one graph
        before, ops = launched(), collections.Counter(state["kernels"].ops)
        original_replay(e)
        state["in_graphs"] += launched() - before
        state["graph_ops"] += state["kernels"].ops - ops

    def read_round(res):  # the host read ends a round's device work
        stop()
        B, N = res.output_tokens.shape
        tokens = torch.full((B, N), -1, dtype=torch.long)
        accept_len, nodes = torch.zeros(B, dtype=torch.long), torch.full((B, N), -1, dtype=torch.long)
        if shape.get("tree") and N > 2:  # a tree round accepts its root's second child: its K/V moves
            accept_len[:], nodes[:, 0], tokens[:, 1] = 1, 2, 3
        tokens[:, 0] = 3
        start()
        return accept_len, nodes, tokens

    with mock.patch.object(speculative, "_read_round", read_round), \
            mock.patch.object(Replays, "replay", staticmethod(replay)):
        start()
        out = speculative.speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens,
                                               eos_token_id=None, verify_backend="triton", **shape)
        stop()
    rounds.pop()  # after the last read: the loop's end (releases), no round
    return {"shape": {k: v for k, v in shape.items() if v is not None}, "rounds": out.stats.rounds,
            "per_round": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", nargs="*", default=None, help="drafter names (default: all four)")
    p.add_argument("--batch", type=int, nargs="*", default=[1])
    p.add_argument("--queries", type=int, nargs="*", default=[1], help="queries per request (tree level width)")
    p.add_argument("--k", type=int, nargs="*", default=[1], help="top_tokens k (tree branching)")
    p.add_argument("--query-position", default="last_cached", choices=("last_cached", "next"),
                   help="the steps' context: next = Hugging Face's, its sliding windows one entry wider")
    p.add_argument("--rounds", action="store_true", help="count a k = 4 chain and a (2, 2, 1) tree round instead")
    p.add_argument("--host-time", action="store_true", help="also time the eager step's host side (host_us)")
    p.add_argument("--decode", action="store_true",
                   help="count the rounds of speculative_generate on the embedded pair instead (transfers too)")
    args = p.parse_args(argv)
    from gemma4_mtp_kernels.drafter_shapes import DRAFTERS

    import triton
    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: launch counting records the real @triton.jit launches")
    names = args.drafter or list(DRAFTERS)
    if args.decode:
        rows = [count_decode(shape) for shape in (dict(num_draft_tokens=4), dict(num_draft_tokens=None, tree=(2, 2, 1)),
                                                   dict(num_draft_tokens=0),
                                                   dict(num_draft_tokens=4, temperature=0.8))]
    elif args.rounds:
        rows = [count_round(n, w, B) for n in names for B in args.batch for w in ((1, 1, 1, 1), (2, 2, 1))]
    else:
        rows = [count_step(n, B, Q=Q, k=k, host_time=args.host_time, query_position=args.query_position)
                for n in names for B in args.batch for Q in args.queries for k in args.k]
    json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
